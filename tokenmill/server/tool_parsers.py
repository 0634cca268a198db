"""Tool calls in a model's free text (tool_choice "auto"), in the format its chat template teaches it
(`--tool-call-parser`):

- hermes (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  once or several times, with text around them;
- llama3_json (Llama 3.1-3.3): the whole reply is `{"name": ..., "parameters": {...}}`, several
  separated by ";", maybe after `<|python_tag|>` (a special token: usually already dropped from the text).

Text outside the calls stays content. An output whose calls do not parse (malformed JSON, no name,
arguments that are not an object, a reply cut by max_tokens) is all content, with no calls: the client
gets what the model wrote, never an error."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from tokenmill.server.tags import partial_tag
from tokenmill.server.tool_json import DECODER, ParsedCall, call_from_text, skip_space
from tokenmill.server.tool_stream import CallPiece, CallsScanner, HermesCallsScanner

__all__ = ["ParsedCall", "ParsedOutput", "ToolParser", "ToolCallStream", "TOOL_PARSERS"]


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None: nothing but tool calls (and whitespace)
    calls: list[ParsedCall]


class ToolParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """A whole output's content and tool calls."""

    @abstractmethod
    def split(self, pending: str, at_start: bool) -> tuple[int, bool]:
        """For streaming, of `pending` (output not sent yet; `at_start`: nothing was sent before it):
        how many characters are surely content, and whether a tool call has begun after them (then
        the rest waits for the end of the output). Content released this way is always where
        `parse` of the whole output puts it: at the start of its content."""

    def calls_scanner(self) -> CallsScanner:
        """Finds the calls, as they stream, in what follows the point where `split` saw one begin."""
        return CallsScanner()


def _plain(text: str) -> ParsedOutput:
    return ParsedOutput(text, [])


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    # A call runs to its closing tag, or to the end of the output (models often stop without one).
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        if self.START not in text:
            return _plain(text)
        content: list[str] = []
        calls: list[ParsedCall] = []
        last = 0
        for match in self._CALL.finditer(text):
            call = call_from_text(match.group(1))
            if call is None:
                return _plain(text)
            calls.append(call)
            content.append(text[last : match.start()])
            last = match.end()
        content.append(text[last:])
        joined = "".join(content)
        return ParsedOutput(joined if joined.strip() else None, calls)

    def split(self, pending: str, at_start: bool) -> tuple[int, bool]:
        start = pending.find(self.START)
        if start >= 0:
            return start, True
        # Hold back an end of the text that may be the start tag's beginning ("<tool_").
        return len(pending) - partial_tag(pending, self.START), False

    def calls_scanner(self) -> CallsScanner:
        return HermesCallsScanner()


class Llama3JsonParser(ToolParser):
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        rest = text.strip()
        if rest.startswith(self.TAG):
            rest = rest[len(self.TAG) :].lstrip()
        if not rest.startswith("{"):
            return _plain(text)
        calls: list[ParsedCall] = []
        pos = 0
        try:
            while True:
                _, end = DECODER.raw_decode(rest, pos)
                call = call_from_text(rest[pos:end])
                if call is None:
                    return _plain(text)
                calls.append(call)
                pos = skip_space(rest, end)
                if pos == len(rest):
                    return ParsedOutput(None, calls)
                if rest[pos] != ";":
                    return _plain(text)
                pos = skip_space(rest, pos + 1)
        except (ValueError, RecursionError):
            return _plain(text)

    def split(self, pending: str, at_start: bool) -> tuple[int, bool]:
        if not at_start:
            return len(pending), False  # a reply that began as text is not a call
        head = pending.lstrip()
        if head.startswith("{") or head.startswith(self.TAG):
            return 0, True
        if self.TAG.startswith(head):  # only whitespace so far, or the tag's beginning
            return 0, False
        return len(pending), False


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


class ToolCallStream:
    """One choice's streamed output under a parser: text streams as content until a tool call may
    have begun; what follows goes to the parser's calls scanner (the calls' pieces as they come), and
    is parsed whole when the output ends. Each delta is looked at a bounded number of times (only a
    short held-back tail is looked at again), so the cost stays linear in the output."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.scanner = parser.calls_scanner()
        self.pieces: list[str] = []  # the whole output so far
        self.pending = ""  # not sent, not yet known to be content
        self.num_sent = 0  # characters sent as content
        self.begun = False

    def feed(self, delta: str) -> str:
        """The content to send now for this new piece of output."""
        return self.step(delta)[0]

    def step(self, delta: str) -> tuple[str, list[CallPiece]]:
        """The content to send now for this new piece of output, and the calls' new pieces."""
        self.pieces.append(delta)
        if self.begun:
            return "", self.scanner.feed(delta)
        self.pending += delta
        end, self.begun = self.parser.split(self.pending, self.num_sent == 0)
        piece, self.pending = self.pending[:end], self.pending[end:]
        self.num_sent += len(piece)
        return piece, (self.scanner.feed(self.pending) if self.begun else [])

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The content still to send, and the tool calls, once the output has ended."""
        parsed = self.parser.parse("".join(self.pieces))
        rest = (parsed.content or "")[self.num_sent :]
        return ("" if parsed.calls and not rest.strip() else rest), parsed.calls
