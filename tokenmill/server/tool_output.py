"""A choice's output as the assistant's reply under a ToolPlan: content, or tool calls (each with a fresh
id; finish_reason "tool_calls"), whole or as it streams. Streamed calls go out whole, in the choice's
last chunk, as OpenAI's `delta.tool_calls` entries (index, id, type, function {name, arguments}), which
the openai SDK assembles: under "required" or a named function the constrained JSON is held until it
ends; under "auto" text streams until a tool call may have begun (tool_parsers.ToolCallStream)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.server.protocol import FunctionCall, ToolCall
from tokenmill.server.tool_parsers import ParsedCall, ToolCallStream
from tokenmill.server.tools import ToolPlan, constrained_calls


@dataclass(frozen=True)
class Reply:
    content: str | None
    tool_calls: list[ToolCall] | None
    finish_reason: str | None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole_reply(plan: ToolPlan, text: str, finish_reason: str | None) -> Reply:
    """The reply of a finished, unstreamed choice."""
    if plan.parser is not None:
        parsed = plan.parser.parse(text)
        content, calls = parsed.content, _limit(plan, parsed.calls)
    elif plan.constrained:
        calls = _limit(plan, constrained_calls(plan, text) or [])
        content = None if calls else text
    else:
        return Reply(text, None, finish_reason)
    if not calls:
        return Reply(text, None, finish_reason)
    tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return Reply(content, tool_calls, "tool_calls")


class ReplyStream:
    """One choice's reply as its output streams: `feed` each new piece of text, `finish` at its end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parsing = ToolCallStream(plan.parser) if plan.parser is not None else None
        self.held: list[str] = []  # a constrained output, until it ends

    def feed(self, delta: str) -> str:
        """The content to send now."""
        if self.parsing is not None:
            return self.parsing.feed(delta)
        if self.plan.constrained:
            self.held.append(delta)
            return ""
        return delta

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict[str, Any]] | None, str | None]:
        """The content still to send, the `delta.tool_calls` entries (None: no calls), the finish_reason."""
        if self.parsing is not None:
            rest, calls = self.parsing.finish()
        elif self.plan.constrained:
            text = "".join(self.held)
            calls = constrained_calls(self.plan, text) or []
            rest = "" if calls else text
        else:
            return "", None, finish_reason
        calls = _limit(self.plan, calls)
        if not calls:
            return rest, None, finish_reason
        deltas = [
            {"index": i, "id": new_call_id(), "type": "function", "function": _function(c)} for i, c in enumerate(calls)
        ]
        return rest, deltas, "tool_calls"


def _function(call: ParsedCall) -> dict[str, str]:
    return {"name": call.name, "arguments": call.arguments}


def _limit(plan: ToolPlan, calls: list[ParsedCall]) -> list[ParsedCall]:
    """parallel_tool_calls false: the first call only (a constrained output has one already)."""
    return calls if plan.parallel else calls[:1]
