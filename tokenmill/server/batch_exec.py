"""One Batch API line run in-process, without HTTP, through the route's own pieces (prepare -> admit ->
finish -> the unstreamed reply), so its body is what the online route answers for the same request."""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import ValidationError

from tokenmill.scheduling.request import BACKGROUND_PRIORITY
from tokenmill.server.admission import admit
from tokenmill.server.batch_lines import BatchLine
from tokenmill.server.chat import chat_response, prepare_chat
from tokenmill.server.completions import completion_response, prepare_completion
from tokenmill.server.config import ServerState
from tokenmill.server.embeddings import embeddings_response
from tokenmill.server.embeddings_protocol import EmbeddingRequest
from tokenmill.server.errors import INTERNAL_ERROR_MESSAGE, APIError, error_body
from tokenmill.server.job import Job
from tokenmill.server.pool.pool import state_for_model
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, new_id
from tokenmill.server.streaming import finish

logger = logging.getLogger(__name__)


class RetryLater(Exception):
    """The server is full (a 429 or a 503 that passes): the line runs again later, it has not failed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"retry in {seconds} s")
        self.seconds = seconds


async def run_line(
    state: ServerState, key: str, line: BatchLine, priority: int = BACKGROUND_PRIORITY
) -> tuple[int, Any]:
    """The line's (status code, response body); RetryLater when the server is momentarily full."""
    try:
        if line.url == "/v1/chat/completions":
            return 200, await _chat(state, key, ChatCompletionRequest.model_validate(line.body), priority)
        if line.url == "/v1/completions":
            return 200, await _completion(state, key, CompletionRequest.model_validate(line.body), priority)
        return 200, await _embeddings(state, key, EmbeddingRequest.model_validate(line.body))
    except ValidationError as exc:
        return 400, error_body(400, _validation_message(exc), "invalid_request")
    except APIError as exc:
        if exc.status == 429 or (exc.status == 503 and exc.code != "engine_dead"):
            raise RetryLater(float(exc.headers.get("Retry-After", "1"))) from exc
        return exc.status, exc.body()
    except RetryLater:
        raise
    except Exception:
        logger.exception("a batch line (custom_id %r) failed", line.custom_id)
        return 500, error_body(500, INTERNAL_ERROR_MESSAGE, "internal_error")


def _no_stream(stream: bool | None) -> None:
    if stream:
        raise APIError(400, "stream is not supported in a batch: its results go to the output file.", "invalid_request")


async def _chat(state: ServerState, key: str, body: ChatCompletionRequest, priority: int) -> Any:
    _no_stream(body.stream)
    async with state_for_model(state, body.model, key) as target:
        request_id = new_id("chatcmpl")
        with target.limiter.charging_refusals(key):
            prepared, plan = await prepare_chat(target, body, key, request_id)
            _lower(prepared.children, priority)
            job = admit(target, key, [prepared], time.monotonic(), body)
        await _finish(target, job)
        return chat_response(target, body, plan, job, request_id).model_dump()


async def _completion(state: ServerState, key: str, body: CompletionRequest, priority: int) -> Any:
    _no_stream(body.stream)
    async with state_for_model(state, body.model, key) as target:
        request_id = new_id("cmpl")
        with target.limiter.charging_refusals(key):
            prepared = await prepare_completion(target, body, key, request_id)
            for p in prepared:
                _lower(p.children, priority)
            job = admit(target, key, prepared, time.monotonic(), body)
        await _finish(target, job)
        return completion_response(target, body, prepared, job, request_id).model_dump()


async def _finish(state: ServerState, job: Job) -> None:
    """Run the job to its end. One the server aborted (a shutdown past its drain time) is no answer:
    the line runs again, after the restart if it is one."""
    await finish(state, job, None)
    if any(o.finish_reason == "abort" for out in job.outputs.values() for o in out.outputs):
        raise RetryLater(1.0)


def _lower(children: list[Any], priority: int) -> None:
    for child in children:
        child.priority = priority


async def _embeddings(state: ServerState, key: str, body: EmbeddingRequest) -> Any:
    # Its priority is the request's own (0 unless the key may set one): the idle gate still holds it back.
    async with state_for_model(state, body.model, key) as target:
        return (await embeddings_response(target, body, key)).model_dump()


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{first.get('msg', 'invalid value')}{f' at {where}' if where else ''}."
