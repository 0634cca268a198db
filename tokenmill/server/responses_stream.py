"""A streamed response: server-sent events with `event: <type>` lines and numbered data, in the order
OpenAI's Responses API sends them:

    response.created, response.in_progress,
    with --reasoning-parser, a reasoning item: response.output_item.added, response.content_part.added,
    response.reasoning_text.delta ..., response.reasoning_text.done, response.content_part.done,
    response.output_item.done (once the answer begins),
    the message: response.output_item.added, response.content_part.added,
    response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done,
    each function call: response.output_item.added (once its name is known),
    response.function_call_arguments.delta ... (its arguments as the model writes them),
    response.function_call_arguments.done, response.output_item.done,
    response.completed (or response.incomplete: cut by max_output_tokens, or cancelled).

An item opened stays open until the reply ends (the reasoning until the answer begins), and is done
in output order. An error after the stream began is an `error` event, then response.failed. No
`[DONE]` line: the Responses API ends with its last event."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.server.config import ServerState
from tokenmill.server.errors import INTERNAL_ERROR_MESSAGE, APIError
from tokenmill.server.job import Job, run_job
from tokenmill.server.responses_protocol import (
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseError,
    ResponseObject,
)
from tokenmill.server.responses_translate import final_status, finished, item_status_of, new_item_id
from tokenmill.server.tool_output import ReplyDelta, ReplyStream
from tokenmill.server.tools import ToolPlan

logger = logging.getLogger(__name__)


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
    reply, items = ReplyStream(plan), _Items(event)
    finish_reason: str | None = None
    try:
        async for _, request_output in run_job(state, job):
            out = request_output.outputs[0]
            delta = reply.advance(out.delta_text)
            for frame in items.add(delta):
                yield frame
            if out.finished:
                delta = reply.close(out.finish_reason)
                finish_reason = delta.finish_reason
                for frame in items.add(delta):
                    yield frame
        status = final_status(finish_reason, cancelled())
        for frame in items.finish(item_status_of(status)):
            yield frame
        final = finished(base, status, items.output(), job)
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


ItemKind = Literal["reasoning", "message", "function_call"]


@dataclass
class _Item:
    """An output item as it forms: its kind, its text so far (reasoning, message text or arguments)."""

    kind: ItemKind
    id: str
    index: int  # output_index
    pieces: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    status: ItemStatus = "in_progress"

    @property
    def is_open(self) -> bool:
        return self.status == "in_progress"

    def built(self, status: ItemStatus) -> OutputItem:
        text = "".join(self.pieces)
        if self.kind == "reasoning":
            return OutputReasoning(id=self.id, status=status, content=[ReasoningText(text=text)])
        if self.kind == "message":
            return OutputMessage(id=self.id, status=status, content=[OutputText(text=text)])
        return OutputFunctionCall(id=self.id, call_id=self.call_id, name=self.name, arguments=text, status=status)


class _Items:
    """A streamed reply's output items and their events, from ReplyStream's deltas."""

    def __init__(self, event: _Events) -> None:
        self.event = event
        self.items: list[_Item] = []
        self.reasoning: _Item | None = None
        self.message: _Item | None = None
        self.calls: dict[int, _Item] = {}  # by the call's index in the reply

    def add(self, delta: ReplyDelta) -> list[str]:
        frames: list[str] = []
        if delta.reasoning:
            if self.reasoning is None:
                self.reasoning = self._open("reasoning", "rs", frames)
            frames.append(self._text_delta(self.reasoning, delta.reasoning))
        if (delta.content or delta.tool_calls) and self.reasoning is not None and self.reasoning.is_open:
            frames += self._close(self.reasoning, "completed")
        if delta.content:
            if self.message is None:
                self.message = self._open("message", "msg", frames)
            frames.append(self._text_delta(self.message, delta.content))
        for entry in delta.tool_calls:
            call = self.calls.get(entry["index"])
            if call is None:  # its first entry names it
                call = self.calls[entry["index"]] = self._open("function_call", "fc", frames, entry)
            if arguments := entry["function"]["arguments"]:
                call.pieces.append(arguments)
                where = {"item_id": call.id, "output_index": call.index}
                frames.append(self.event("response.function_call_arguments.delta", **where, delta=arguments))
        return frames

    def finish(self, status: ItemStatus) -> list[str]:
        """Close what is open; a reply with no reasoning, text or call is an empty message, as unstreamed."""
        frames: list[str] = []
        if not self.items:
            self.message = self._open("message", "msg", frames)
        for item in self.items:
            if item.is_open:
                frames += self._close(item, status)
        return frames

    def output(self) -> list[OutputItem]:
        return [item.built(item.status) for item in self.items]

    def _open(self, kind: ItemKind, prefix: str, frames: list[str], call: dict[str, Any] | None = None) -> _Item:
        item = _Item(kind, new_item_id(prefix), len(self.items))
        if call is not None:
            item.call_id, item.name = call["id"], call["function"]["name"]
        self.items.append(item)
        added = item.built("in_progress").model_dump()
        part = added["content"].pop() if kind != "function_call" else None  # added next, as its own event
        frames.append(self.event("response.output_item.added", output_index=item.index, item=added))
        if part is not None:
            where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
            frames.append(self.event("response.content_part.added", **where, part=part))
        return item

    def _text_delta(self, item: _Item, text: str) -> str:
        item.pieces.append(text)
        kind = "response.reasoning_text.delta" if item.kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if item.kind == "message" else {}
        return self.event(kind, item_id=item.id, output_index=item.index, content_index=0, delta=text, **extra)

    def _close(self, item: _Item, status: ItemStatus) -> list[str]:
        item.status = status
        built = item.built(status)
        where = {"item_id": item.id, "output_index": item.index}
        if isinstance(built, OutputFunctionCall):
            return [
                self.event("response.function_call_arguments.done", **where, arguments=built.arguments),
                self.event("response.output_item.done", output_index=item.index, item=built.model_dump()),
            ]
        text = built.content[0].text
        kind = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
        extra: dict[str, Any] = {"logprobs": []} if item.kind == "message" else {}
        part = built.model_dump()["content"][0]
        return [
            self.event(kind, **where, content_index=0, text=text, **extra),
            self.event("response.content_part.done", **where, content_index=0, part=part),
            self.event("response.output_item.done", output_index=item.index, item=built.model_dump()),
        ]
