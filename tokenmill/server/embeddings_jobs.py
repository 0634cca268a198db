"""Pooling requests (embeddings, classification) as jobs: inputs tokenized off the event loop, prepared
through the engine's one preparation under this server's caps, admitted like any request (queue bounds,
the key's rate limits) and run to their end; what is wrong with them is the API's 400."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request

from tokenmill.engine.input_processor import PreparedRequest
from tokenmill.engine.request_limits import RequestRejected
from tokenmill.pooling_params import PoolingTask
from tokenmill.server.admission import admit
from tokenmill.server.config import ServerState
from tokenmill.server.errors import APIError
from tokenmill.server.job import Job
from tokenmill.server.prepare import request_caps
from tokenmill.server.prompts import check_prompt_size, tokenize
from tokenmill.server.streaming import finish


@dataclass
class PoolingResult:
    """The pooled vectors in input order, each input's token count, and the job (its admission headers)."""

    vectors: list[list[float]]
    num_tokens: list[int]
    job: Job

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.num_tokens)


def check_pooling(state: ServerState, task: PoolingTask) -> None:
    """400 when the served model cannot do `task` (a classifier cannot embed, and the reverse)."""
    try:
        state.engine.pooling.params(task)
    except ValueError as exc:
        raise APIError(400, str(exc), "unsupported_model", "model") from exc


async def run_pooling(
    state: ServerState,
    key: str,
    request_id: str,
    inputs: list[str | list[int]],
    task: PoolingTask,
    priority: int,
    cache_salt: str | None,
    request: Request | None,
) -> PoolingResult:
    """Run one pooling request per input; `request` (None for a Batch API line) aborts them if its
    client leaves."""
    arrival = time.monotonic()
    with state.limiter.charging_refusals(key):
        state.check_accepting()
        check_pooling(state, task)
        for item in inputs:
            check_prompt_size(state, item)
        caps = request_caps(state, None)
        prepared: list[PreparedRequest] = []
        for i, item in enumerate(inputs):
            _, ids = await tokenize(state, item)
            try:
                prepared.append(
                    state.engine.prepare_pooling(
                        f"{request_id}-{i}", ids, task, state.priority(key, priority), cache_salt, caps
                    )
                )
            except RequestRejected as exc:
                raise APIError(400, f"input {i}: {exc}", exc.code, exc.param) from exc
            except ValueError as exc:
                raise APIError(400, f"input {i}: {exc}", "invalid_request", "input") from exc
        job = admit(state, key, prepared, arrival)
    await finish(state, job, request)
    vectors = []
    for i in range(len(prepared)):
        pooled = job.outputs[i].pooled if i in job.outputs else None
        if pooled is None:  # aborted (shutdown): no vector to give
            raise APIError(503, "the request was aborted before its input was computed; retry.", "aborted")
        vectors.append(pooled)
    return PoolingResult(vectors, [len(p.prompt_token_ids) for p in prepared], job)
