"""A job's response: streamed as server-sent events (closing the job however the stream ends), or run
to its end for one JSON body; either way a client that goes away aborts it."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.server.audit import attach_job
from tokenmill.server.config import ServerState
from tokenmill.server.errors import INTERNAL_ERROR_MESSAGE, APIError, sse_error
from tokenmill.server.job import Job, close, run_job

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "the client closed the connection.", "client_closed")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_frames(frames: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frames of a stream, then [DONE]; an error mid-stream becomes an error frame first."""
    try:
        async for frame in frames:
            yield frame
    except APIError as exc:
        yield sse_error(exc.status, exc.message, exc.code)
    except Exception:
        logger.exception("a stream failed")
        yield sse_error(500, INTERNAL_ERROR_MESSAGE, "internal_error")
    yield SSE_DONE


class JobStreamingResponse(StreamingResponse):
    """A stream that closes its job however it ends, even when the client left before it began, then
    calls `on_close`. `framing` turns the frames into the API's stream: OpenAI's SSE with its error frame
    and [DONE] by default; the Responses and Messages APIs end their streams their own way."""

    def __init__(
        self,
        state: ServerState,
        job: Job,
        frames: AsyncIterator[str],
        framing: Callable[[AsyncIterator[str]], AsyncIterator[str]] = sse_frames,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            framing(frames),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **job.admission.headers},
        )
        self.state, self.job, self.on_close = state, job, on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        attach_job(scope, self.job)
        try:
            await super().__call__(scope, receive, send)
        finally:
            close(self.state, self.job)
            if self.on_close is not None:
                self.on_close()


async def finish(state: ServerState, job: Job, request: Request | None) -> None:
    """Run an unstreamed job to its end; a client that disconnects first aborts it. Without a request
    (the Batch API's lines) it just runs; cancelling the caller aborts it."""
    try:
        if request is None:
            return await _drain(state, job)
        attach_job(request.scope, job)
        await until_disconnect(request, _drain(state, job))
    finally:
        close(state, job)


async def _drain(state: ServerState, job: Job) -> None:
    async for _ in run_job(state, job):
        pass
