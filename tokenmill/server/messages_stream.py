"""A streamed Messages reply as Anthropic's server-sent events (`event: <type>` then `data: <json>`):
message_start, ping, then per content block content_block_start, content_block_delta (text_delta, or
input_json_delta for a tool_use block's input), content_block_stop, and at the end message_delta
(stop_reason, stop_sequence, usage) and message_stop. Text streams as it comes; tool calls come as
ReplyStream gives them, at the end, each as its own tool_use block. An error after the stream began is
an `error` event (its status code is already sent)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from tokenmill.server.anthropic_errors import anthropic_error_body
from tokenmill.server.anthropic_reply import stop_reason, tool_use_id, usage
from tokenmill.server.audit import attach_job
from tokenmill.server.config import ServerState
from tokenmill.server.errors import INTERNAL_ERROR_MESSAGE, APIError
from tokenmill.server.job import Job, close, run_job
from tokenmill.server.tool_output import ReplyStream
from tokenmill.server.tools import ToolPlan

logger = logging.getLogger(__name__)


def event(data: dict[str, Any]) -> str:
    """One server-sent event, named by its data's type, as Anthropic sends them."""
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def message_events(state: ServerState, plan: ToolPlan, job: Job, message_id: str) -> AsyncIterator[str]:
    start: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": state.model_name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": job.num_prompt_tokens, "output_tokens": 0},
    }
    yield event({"type": "message_start", "message": start})
    yield event({"type": "ping"})
    reply = ReplyStream(plan)
    blocks = 0  # content blocks started
    text_open = False
    async for _, output in run_job(state, job):
        out = output.outputs[0]
        if out.finish_reason == "abort":  # past a deadline: run_job raises the error next
            continue
        text = reply.feed(out.delta_text)
        calls, finish_reason = None, None
        if out.finished:
            rest, calls, finish_reason = reply.finish(out.finish_reason)
            text += rest
        if text:
            if not text_open:
                yield event(
                    {"type": "content_block_start", "index": blocks, "content_block": {"type": "text", "text": ""}}
                )
                text_open, blocks = True, blocks + 1
            yield event(
                {"type": "content_block_delta", "index": blocks - 1, "delta": {"type": "text_delta", "text": text}}
            )
        if not out.finished:
            continue
        if text_open:
            yield event({"type": "content_block_stop", "index": blocks - 1})
        for call in calls or []:
            function = call["function"]
            block = {"type": "tool_use", "id": tool_use_id(), "name": function["name"], "input": {}}
            yield event({"type": "content_block_start", "index": blocks, "content_block": block})
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            yield event({"type": "content_block_delta", "index": blocks, "delta": delta})
            yield event({"type": "content_block_stop", "index": blocks})
            blocks += 1
        reason, sequence = stop_reason(finish_reason, out.stop_reason)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield event({"type": "message_delta", "delta": delta, "usage": usage(job).model_dump()})
        yield event({"type": "message_stop"})


async def _frames(events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for frame in events:
            yield frame
    except APIError as exc:
        yield event(anthropic_error_body(exc.status, exc.message))
    except Exception:
        logger.exception("a stream failed")
        yield event(anthropic_error_body(500, INTERNAL_ERROR_MESSAGE))


class MessageStreamingResponse(StreamingResponse):
    """Anthropic's events of a job's reply; the job is closed however the stream ends."""

    def __init__(self, state: ServerState, job: Job, events: AsyncIterator[str]) -> None:
        super().__init__(
            _frames(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **job.admission.headers},
        )
        self.state, self.job = state, job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        attach_job(scope, self.job)
        try:
            await super().__call__(scope, receive, send)
        finally:
            close(self.state, self.job)
