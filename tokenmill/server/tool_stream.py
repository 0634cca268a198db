"""Tool calls found while their text streams, for `delta.tool_calls` as OpenAI sends them: a call's first
piece carries its name as soon as the name is complete and its arguments have begun, the next pieces its
arguments' text as the model writes it (tool_json.py: the pieces add up to the finished call's arguments).

Where a call object begins depends on the output's format: after a `<tool_call>` tag (hermes), at each
`{` between calls of a JSON sequence (an array of calls for tool_choice "required", llama3_json's calls
separated by ";"), or the whole output is one function's arguments (a named tool_choice). Inside an
object, members are read with the JSON decoder once they are complete, except the arguments object,
which is passed on character by character up to its closing brace. The finished output is parsed whole
too (tool_parsers.py, tools.py): it decides what the reply's calls are; what streamed is its prefix."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.server.tags import partial_tag
from tokenmill.server.tool_json import ARGUMENT_KEYS, DECODER, NO_ARGUMENTS_TEXT, arguments_text, skip_space


@dataclass(frozen=True)
class CallPiece:
    index: int  # the call's place among the reply's calls
    arguments: str  # the next piece of its arguments' text
    name: str | None = None  # the call's first piece: its name


class CallObject:
    """One call object's text as it streams in: its name once complete, its arguments' text so far."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # where reading goes on
        self.state = "open"  # open -> key -> colon -> value (-> arguments) -> key ... -> closed | bad
        self.key = ""
        self.name: str | None = None
        self.arguments: str | None = None  # the arguments' text so far (None: none seen yet)
        self.depth = 0  # of brackets inside the arguments object
        self.in_string = self.escaped = False

    def feed(self, text: str) -> str | None:
        """Read `text`; once the object has closed, the text after it (else None)."""
        self.text += text
        while self.state not in ("closed", "bad"):
            if self.state == "arguments":
                if not self._scan_arguments():
                    return None
                continue
            self.pos = skip_space(self.text, self.pos)
            if self.pos == len(self.text) or not self._step(self.text[self.pos]):
                return None
        if self.state == "bad":
            return None
        rest, self.text = self.text[self.pos :], self.text[: self.pos]
        return rest

    def _step(self, char: str) -> bool:
        """One step of the members' grammar at `char`; False: wait for more text."""
        if self.state == "open":
            self.state, self.pos = ("key", self.pos + 1) if char == "{" else ("bad", self.pos)
        elif self.state == "key":
            if char in ",}":
                self.state = "closed" if char == "}" else "key"
                self.pos += 1
            elif char == '"':
                return self._decode("colon")
            else:
                self.state = "bad"
        elif self.state == "colon":
            self.state, self.pos = ("value", self.pos + 1) if char == ":" else ("bad", self.pos)
        elif self.key in ARGUMENT_KEYS and char == "{" and self.arguments is None:
            self.state, self.arguments = "arguments", ""
        else:
            return self._decode("key")
        return True

    def _decode(self, then: str) -> bool:
        """A key or a member's whole value: decoded once complete (a failure may be an incomplete one)."""
        try:
            value, end = DECODER.raw_decode(self.text, self.pos)
        except (ValueError, RecursionError):
            return False
        if end == len(self.text) and isinstance(value, (int, float)) and not isinstance(value, bool):
            return False  # a number at the end of the text so far may go on
        self.state, self.pos = then, end
        if then == "colon":
            self.key = value
        elif self.key == "name":
            self.name = value if isinstance(value, str) else None
            self.state = "key" if self.name is not None else "bad"
        elif self.key in ARGUMENT_KEYS and self.arguments is None:
            # Arguments given as a string holding an object's JSON: that text, whole; anything else is no call.
            self.arguments = arguments_text(value) if isinstance(value, str) else None
            self.state = "key" if self.arguments is not None else "bad"
        return True

    def _scan_arguments(self) -> bool:
        """Take the arguments object's characters up to its closing brace; True once it has closed."""
        start = self.pos
        for i in range(self.pos, len(self.text)):
            char = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.arguments = (self.arguments or "") + self.text[start : i + 1]
                    self.state, self.pos = "key", i + 1
                    return True
        self.arguments = (self.arguments or "") + self.text[start:]
        self.pos = len(self.text)
        return False


class CallsScanner:
    """The calls of a JSON sequence (each `{` between calls begins one); subclasses find calls elsewhere."""

    def __init__(self) -> None:
        self.current: CallObject | None = None
        self.num_calls = 0  # calls whose name was sent
        self.sent: int | None = None  # of the current call's arguments (None: its name is not sent yet)

    def feed(self, text: str) -> list[CallPiece]:
        pieces: list[CallPiece] = []
        while text:
            if self.current is None:
                found = self._object_start(text)
                if found is None:
                    break
                self.current, self.sent = CallObject(), None
                text = found
            rest = self.current.feed(text)
            pieces += self._pieces(self.current, rest is not None)
            if rest is None:
                break
            self.current, text = None, rest
            self._after_object()
        return pieces

    def _object_start(self, text: str) -> str | None:
        """`text` from where the next call object begins, or None (what it held may wait for more)."""
        start = text.find("{")
        return None if start < 0 else text[start:]

    def _after_object(self) -> None:
        pass

    def _pieces(self, call: CallObject, closed: bool) -> list[CallPiece]:
        pieces: list[CallPiece] = []
        if self.sent is None:
            # The name goes out once the arguments have begun too: a call whose arguments do not even
            # begin as JSON (the whole output is then content) sends nothing.
            if call.name is None or (call.arguments is None and not closed):
                return pieces
            pieces.append(CallPiece(self.num_calls, "", call.name))
            self.num_calls, self.sent = self.num_calls + 1, 0
        arguments = call.arguments
        if closed and arguments is None:
            arguments = NO_ARGUMENTS_TEXT
        if arguments is not None and len(arguments) > self.sent:
            pieces.append(CallPiece(self.num_calls - 1, arguments[self.sent :]))
            self.sent = len(arguments)
        return pieces


class HermesCallsScanner(CallsScanner):
    """Calls in `<tool_call>` tags: an object begins at the first `{` after a tag."""

    TAG = "<tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.tagged = False
        self.held = ""  # the end of the text after a call, that may be a tag's beginning

    def _object_start(self, text: str) -> str | None:
        if not self.tagged:
            text, self.held = self.held + text, ""
            tag = text.find(self.TAG)
            if tag < 0:
                self.held = text[len(text) - partial_tag(text, self.TAG) :]
                return None
            self.tagged, text = True, text[tag + len(self.TAG) :]
        return super()._object_start(text)

    def _after_object(self) -> None:
        self.tagged = False


class ArgumentsScanner:
    """A named function's constrained output: the whole output is its arguments (surrounding whitespace
    left out, as the finished reply's arguments leave it out)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.named = self.begun = False  # the name was sent; the arguments' first character came
        self.held = ""  # whitespace that may end the output

    def feed(self, text: str) -> list[CallPiece]:
        pieces = [] if self.named else [CallPiece(0, "", self.name)]
        self.named = True
        self.held += text
        if not self.begun:
            self.held = self.held.lstrip()
        body = self.held.rstrip()
        if body:
            self.begun = True
            pieces.append(CallPiece(0, body))
            self.held = self.held[len(body) :]
        return pieces
