"""A tokenized request to the engine's prepared request, through the one preparation the offline API
shares (InputProcessor.process: validation, max_tokens, the prompt's length, the output constraint),
under this server's caps; what it refuses becomes the API's 400 error object."""

from __future__ import annotations

from tokenmill.engine.input_processor import PreparedRequest
from tokenmill.engine.request_limits import RequestCaps, RequestRejected
from tokenmill.lora_request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.config import ServerState
from tokenmill.server.constraints import check_compiles
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
    lora_request: LoRARequest | None = None,
) -> PreparedRequest:
    """The engine's checks of a tokenized request (400 on failure). A request with an output constraint
    checks its grammar first, on a compile thread within the server's deadline: the rest of the
    checks then find it checked."""
    caps = request_caps(state, default_max_tokens)
    try:
        if params.structured_outputs is not None:
            timeout_s = state.config.grammar_compile_timeout_s
            await check_compiles(state.engine.inputs.grammars, params.structured_outputs, timeout_s)
        inputs = state.engine.inputs
        prompt = prompt_text or prompt_ids
        return inputs.process(request_id, prompt, params, priority, prompt_ids, cache_salt, caps, lora_request)
    except RequestRejected as exc:
        raise APIError(400, str(exc), exc.code, exc.param) from exc
    except (ValueError, RecursionError) as exc:  # RecursionError: a schema nested beyond reason
        message = str(exc) if isinstance(exc, ValueError) else "the output constraint is nested too deeply."
        raise APIError(400, message, "invalid_request") from exc
