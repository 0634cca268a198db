"""A streamed response: server-sent events with `event: <type>` lines and numbered data, in the order
OpenAI's Responses API sends them:

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done,
    then for each function call: response.output_item.added, response.function_call_arguments.delta,
    response.function_call_arguments.done, response.output_item.done,
    response.completed (or response.incomplete: cut by max_output_tokens, or cancelled).

An error after the stream began is an `error` event, then response.failed. No `[DONE]` line: the
Responses API ends with its last event."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from tokenmill.server.audit import attach_job
from tokenmill.server.config import ServerState
from tokenmill.server.errors import INTERNAL_ERROR_MESSAGE, APIError
from tokenmill.server.job import Job, close, run_job
from tokenmill.server.responses_protocol import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
)
from tokenmill.server.responses_translate import final_status, finished, item_status_of, new_item_id
from tokenmill.server.tool_output import ReplyStream
from tokenmill.server.tools import ToolPlan

logger = logging.getLogger(__name__)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that close their job however the stream ends (a client gone aborts it), then
    call `closed` (even when the client left before the first event, and the events never began)."""

    def __init__(self, state: ServerState, job: Job, events: AsyncIterator[str], closed: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **job.admission.headers},
        )
        self.state, self.job, self.closed = state, job, closed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        attach_job(scope, self.job)
        try:
            await super().__call__(scope, receive, send)
        finally:
            close(self.state, self.job)
            self.closed()


class _Events:
    """Numbers the events (sequence_number from 0) and writes them as SSE frames."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def response_events(
    state: ServerState,
    plan: ToolPlan,
    job: Job,
    base: ResponseObject,
    done: Callable[[ResponseObject], None],
    cancelled: Callable[[], bool],
) -> AsyncIterator[str]:
    """The events of one response; `done` gets the final response (to store it) once the events end
    (not when the client leaves first: the caller's `closed` sees to that)."""
    event = _Events()
    yield event("response.created", response=base.model_dump())
    yield event("response.in_progress", response=base.model_dump())
    reply, message_id = ReplyStream(plan), new_item_id("msg")
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    finish_reason: str | None = None
    try:
        async for _, request_output in run_job(state, job):
            out = request_output.outputs[0]
            delta = reply.feed(out.delta_text)
            if out.finished:
                rest, tool_calls, finish_reason = reply.finish(out.finish_reason)
                delta, calls = delta + rest, tool_calls or []
            if delta:
                if not text:
                    for frame in _open_message(event, message_id):
                        yield frame
                text.append(delta)
                yield event(
                    "response.output_text.delta",
                    item_id=message_id,
                    output_index=0,
                    content_index=0,
                    delta=delta,
                    logprobs=[],
                )
        status = final_status(finish_reason, cancelled())
        output: list[OutputItem] = []
        if text or not calls:  # a reply with neither text nor calls is an empty message, as unstreamed
            if not text:
                for frame in _open_message(event, message_id):
                    yield frame
            content = [OutputText(text="".join(text))]
            message = OutputMessage(id=message_id, status=item_status_of(status), content=content)
            output.append(message)
            for frame in _close_message(event, message):
                yield frame
        for call in calls:
            function = call["function"]
            item = OutputFunctionCall(
                id=new_item_id("fc"),
                call_id=call["id"],
                name=function["name"],
                arguments=function["arguments"],
                status="completed",
            )
            for frame in _function_call(event, len(output), item):
                yield frame
            output.append(item)
        final = finished(base, status, output, job)
        done(final)  # stored before the last event: a GET right after the stream sees it
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield event(kind, response=final.model_dump())
    except APIError as exc:
        for frame in _fail(event, base, done, exc.code, exc.message, exc.param):
            yield frame
    except Exception:
        logger.exception("a streamed response failed")
        for frame in _fail(event, base, done, "internal_error", INTERNAL_ERROR_MESSAGE, None):
            yield frame


def _fail(
    event: _Events,
    base: ResponseObject,
    done: Callable[[ResponseObject], None],
    code: str | None,
    message: str,
    param: str | None,
) -> list[str]:
    """An error after the stream began: an `error` event, then response.failed."""
    error = ResponseError(code=code or "server_error", message=message)
    failed = base.model_copy(update={"status": "failed", "error": error})
    done(failed)
    return [
        event("error", code=code, message=message, param=param),
        event("response.failed", response=failed.model_dump()),
    ]


def _open_message(event: _Events, message_id: str) -> list[str]:
    item = OutputMessage(id=message_id, status="in_progress", content=[])
    part = OutputText(text="")
    return [
        event("response.output_item.added", output_index=0, item=item.model_dump()),
        event(
            "response.content_part.added",
            item_id=message_id,
            output_index=0,
            content_index=0,
            part=part.model_dump(),
        ),
    ]


def _close_message(event: _Events, message: OutputMessage) -> list[str]:
    part = message.content[0]
    where = {"item_id": message.id, "output_index": 0, "content_index": 0}
    return [
        event("response.output_text.done", **where, text=part.text, logprobs=[]),
        event("response.content_part.done", **where, part=part.model_dump()),
        event("response.output_item.done", output_index=0, item=message.model_dump()),
    ]


def _function_call(event: _Events, index: int, item: OutputFunctionCall) -> list[str]:
    added = item.model_copy(update={"arguments": "", "status": "in_progress"})
    where = {"item_id": item.id, "output_index": index}
    return [
        event("response.output_item.added", output_index=index, item=added.model_dump()),
        event("response.function_call_arguments.delta", **where, delta=item.arguments),
        event("response.function_call_arguments.done", **where, arguments=item.arguments),
        event("response.output_item.done", output_index=index, item=item.model_dump()),
    ]
