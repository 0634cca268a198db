"""A tokenized request to the engine's prepared request, through the one preparation the offline API
shares (InputProcessor.process: validation, max_tokens, the prompt's length, the output constraint),
under this server's caps; what it refuses becomes the API's 400 error object."""

from __future__ import annotations

import asyncio

from tokenmill.engine.input_processor import PreparedRequest
from tokenmill.engine.request_limits import RequestCaps, RequestRejected
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.config import ServerState
from tokenmill.server.errors import APIError


def request_caps(state: ServerState, default_max_tokens: int | None) -> RequestCaps:
    """This server's caps (--max-tokens-limit, --max-prompt-tokens), with the endpoint's default max_tokens."""
    return RequestCaps(state.max_tokens, state.max_prompt_tokens, default_max_tokens)


async def prepare(
    state: ServerState,
    request_id: str,
    prompt_text: str | None,
    prompt_ids: list[int],
    params: SamplingParams,
    priority: int,
    cache_salt: str | None,
    default_max_tokens: int | None,
) -> PreparedRequest:
    """The engine's checks of a tokenized request (400 on failure). A request with an output constraint
    checks its grammar here: that runs on the prompt thread, off the event loop, like tokenization."""
    caps = request_caps(state, default_max_tokens)

    def process() -> PreparedRequest:
        inputs = state.engine.inputs
        return inputs.process(request_id, prompt_text or prompt_ids, params, priority, prompt_ids, cache_salt, caps)

    try:
        if params.structured_outputs is None:
            return process()
        return await asyncio.get_running_loop().run_in_executor(state.prompt_pool, process)
    except RequestRejected as exc:
        raise APIError(400, str(exc), exc.code, exc.param) from exc
    except (ValueError, RecursionError) as exc:  # RecursionError: a schema nested beyond reason
        message = str(exc) if isinstance(exc, ValueError) else "the output constraint is nested too deeply."
        raise APIError(400, message, "invalid_request") from exc
