"""A streamed Messages reply as Anthropic's server-sent events (`event: <type>` then `data: <json>`):
message_start, ping, then per content block content_block_start, content_block_delta (thinking_delta,
text_delta, or input_json_delta with the next piece of a tool_use block's input), content_block_stop, and
at the end message_delta (stop_reason, stop_sequence, usage) and message_stop. Text and a call's arguments
stream as ReplyStream finds them (tool_output.py). An error after the stream began is an `error` event
(its status code is already sent)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.server.anthropic_errors import anthropic_error_body
from tokenmill.server.anthropic_reply import stop_reason, tool_use_id, usage
from tokenmill.server.config import ServerState
from tokenmill.server.errors import INTERNAL_ERROR_MESSAGE, APIError
from tokenmill.server.job import Job, run_job
from tokenmill.server.tool_output import ReplyDelta, ReplyStream
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
    reply, blocks = ReplyStream(plan), ContentBlocks()
    async for _, output in run_job(state, job):
        out = output.outputs[0]
        if out.finish_reason == "abort":  # past a deadline: run_job raises the error next
            continue
        for frame in blocks.send(reply.advance(out.delta_text)):
            yield frame
        if not out.finished:
            continue
        last = reply.close(out.finish_reason)
        for frame in [*blocks.send(last), *blocks.stop()]:
            yield frame
        reason, sequence = stop_reason(last.finish_reason, out.stop_reason)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield event({"type": "message_delta", "delta": delta, "usage": usage(job).model_dump()})
        yield event({"type": "message_stop"})


class ContentBlocks:
    """The reply's content blocks as they stream: a thinking block (with --reasoning-parser), text, one
    tool_use block per call; a new kind of piece closes the open block and starts the next."""

    def __init__(self) -> None:
        self.count = 0  # blocks started
        self.open: str | None = None  # "thinking", "text", or "tool:<call index>"

    def send(self, delta: ReplyDelta) -> list[str]:
        frames: list[str] = []
        if delta.reasoning:
            frames += self._enter("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            frames.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            frames += self._enter("text", {"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": delta.content}))
        for entry in delta.tool_calls:  # a call's first entry has its id and name, the next ones more arguments
            if "id" in entry:
                block = {"type": "tool_use", "id": tool_use_id(), "name": entry["function"]["name"], "input": {}}
                frames += self._enter(f"tool:{entry['index']}", block)
            if entry["function"]["arguments"]:
                frames.append(self._delta({"type": "input_json_delta", "partial_json": entry["function"]["arguments"]}))
        return frames

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event({"type": "content_block_stop", "index": self.count - 1})]

    def _enter(self, kind: str, block: dict[str, Any]) -> list[str]:
        if self.open == kind:
            return []
        frames = self.stop()
        frames.append(event({"type": "content_block_start", "index": self.count, "content_block": block}))
        self.open, self.count = kind, self.count + 1
        return frames

    def _delta(self, delta: dict[str, Any]) -> str:
        return event({"type": "content_block_delta", "index": self.count - 1, "delta": delta})


async def stream_frames(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then an `error` event if they fail (Anthropic's error object; no [DONE] line)."""
    try:
        async for frame in events:
            yield frame
    except APIError as exc:
        yield event(anthropic_error_body(exc.status, exc.message))
    except Exception:
        logger.exception("a stream failed")
        yield event(anthropic_error_body(500, INTERNAL_ERROR_MESSAGE))
