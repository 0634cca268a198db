"""A choice's output as the assistant's reply under a ToolPlan: its reasoning (with --reasoning-parser,
reasoning.py), then content or tool calls (each with a fresh id; finish_reason "tool_calls"), whole or as
it streams. Tool calls and constraints apply to the part after the reasoning.

Streamed, each call goes out as OpenAI sends it, in `delta.tool_calls` entries the openai SDK assembles:
first {index, id, type, function {name, arguments}} once its name is complete, then {index, function
{arguments}} with the next piece of its arguments' text as the model writes it (tool_stream.py). Under
"auto" text streams as content until a tool call may have begun (tool_parsers.ToolCallStream). The
finished output is parsed whole as well: a call the whole parse does not find (the output broke off
inside it) keeps what streamed, and the choice keeps the engine's finish_reason."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenmill.server.protocol import FunctionCall, ToolCall
from tokenmill.server.reasoning import ReasoningStream
from tokenmill.server.tool_json import ParsedCall
from tokenmill.server.tool_parsers import ToolCallStream
from tokenmill.server.tool_stream import ArgumentsScanner, CallPiece, CallsScanner
from tokenmill.server.tools import ToolPlan, constrained_calls


@dataclass(frozen=True)
class Reply:
    content: str | None
    tool_calls: list[ToolCall] | None
    finish_reason: str | None
    reasoning: str | None = None  # with --reasoning-parser: the reasoning part, if the reply has one


@dataclass
class ReplyDelta:
    """What to send for a new piece of a choice's output (ReplyStream.advance / close)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # `delta.tool_calls` entries
    finish_reason: str | None = None

    def then(self, later: ReplyDelta) -> ReplyDelta:
        """This delta and a later one as one (one `delta.tool_calls` entry per call), with the later's
        finish_reason."""
        calls = {e["index"]: {**e, "function": dict(e["function"])} for e in self.tool_calls}
        for entry in later.tool_calls:
            if entry["index"] in calls:
                calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
            else:
                calls[entry["index"]] = entry
        tool_calls = [calls[i] for i in sorted(calls)]
        return ReplyDelta(
            self.reasoning + later.reasoning, self.content + later.content, tool_calls, later.finish_reason
        )


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole_reply(plan: ToolPlan, text: str, finish_reason: str | None) -> Reply:
    """The reply of a finished, unstreamed choice."""
    if plan.reasoning is None:
        return _tools_reply(plan, text, finish_reason)
    reasoning, text = plan.reasoning.split(text)
    reply = _tools_reply(plan, text, finish_reason)
    if reasoning is None:
        return reply
    return Reply(reply.content or None, reply.tool_calls, reply.finish_reason, reasoning)


def _tools_reply(plan: ToolPlan, text: str, finish_reason: str | None) -> Reply:
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
    """One choice's reply as its output streams: `advance` with each new piece of text, `close` at its
    end. `feed` / `finish` are the same with the calls held and sent whole at the end, and no reasoning
    (for callers that send a call only once it is complete)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.thinking = ReasoningStream(plan.reasoning) if plan.reasoning is not None else None
        self.parsing = ToolCallStream(plan.parser) if plan.parser is not None else None
        self.scanner: CallsScanner | ArgumentsScanner | None = None
        if plan.mode == "named" and plan.function is not None:
            self.scanner = ArgumentsScanner(plan.function)
        elif plan.constrained:
            self.scanner = CallsScanner()
        self.held: list[str] = []  # a constrained output, for its whole parse at the end
        self.ids: list[str] = []  # of the calls whose name went out, by index
        self.whole: dict[int, dict[str, Any]] = {}  # the calls so far, for finish()

    def advance(self, text: str) -> ReplyDelta:
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text)
        content, pieces = self._step(text)
        return ReplyDelta(reasoning, content, self._entries(pieces))

    def close(self, finish_reason: str | None) -> ReplyDelta:
        """What is left to send once the output has ended, and the choice's finish_reason."""
        delta = ReplyDelta(finish_reason=finish_reason)
        if self.thinking is not None:
            delta.reasoning, text = self.thinking.finish()
            delta.content, pieces = self._step(text)
            delta.tool_calls = self._entries(pieces)
        if self.parsing is not None:
            rest, calls = self.parsing.finish()
        elif self.scanner is not None:
            text = "".join(self.held)
            calls = constrained_calls(self.plan, text) or []
            rest = "" if calls else text
        else:
            return delta
        calls = _limit(self.plan, calls)
        if calls:
            delta.finish_reason = "tool_calls"
            delta.tool_calls += [self._whole_entry(i, c) for i, c in enumerate(calls) if i >= len(self.ids)]
        if calls or not self.ids:  # else the text of the call that broke off: it went out as a call
            delta.content += rest
        return delta

    def feed(self, text: str) -> str:
        """The content to send now (the calls wait for `finish`)."""
        delta = self.advance(text)
        self._gather(delta.tool_calls)
        return delta.content

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict[str, Any]] | None, str | None]:
        """The content still to send, the whole `delta.tool_calls` entries (None: no calls), the finish_reason."""
        delta = self.close(finish_reason)
        self._gather(delta.tool_calls)
        calls = [self.whole[i] for i in sorted(self.whole)]
        return delta.content, calls or None, delta.finish_reason

    def _step(self, text: str) -> tuple[str, list[CallPiece]]:
        if self.parsing is not None:
            return self.parsing.step(text)
        if self.scanner is not None:
            self.held.append(text)
            return "", self.scanner.feed(text)
        return text, []

    def _entries(self, pieces: list[CallPiece]) -> list[dict[str, Any]]:
        """The pieces as `delta.tool_calls` entries, one per call."""
        entries: dict[int, dict[str, Any]] = {}
        for piece in pieces:
            if piece.index > 0 and not self.plan.parallel:
                continue
            if piece.name is not None:
                entries[piece.index] = self._whole_entry(piece.index, ParsedCall(piece.name, ""))
            entry = entries.setdefault(piece.index, {"index": piece.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += piece.arguments
        return list(entries.values())

    def _whole_entry(self, index: int, call: ParsedCall) -> dict[str, Any]:
        if index == len(self.ids):
            self.ids.append(new_call_id())
        function = {"name": call.name, "arguments": call.arguments}
        return {"index": index, "id": self.ids[index], "type": "function", "function": function}

    def _gather(self, entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            whole = self.whole.setdefault(entry["index"], {**entry, "function": {**entry["function"], "arguments": ""}})
            whole["function"]["arguments"] += entry["function"]["arguments"]


def _limit(plan: ToolPlan, calls: list[ParsedCall]) -> list[ParsedCall]:
    """parallel_tool_calls false: the first call only (a constrained output has one already)."""
    return calls if plan.parallel else calls[:1]
