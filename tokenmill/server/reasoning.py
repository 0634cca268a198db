"""A reasoning model's reply split into its reasoning and its answer (`--reasoning-parser`), whole or as it
streams. Both parsers know `<think>...</think>`; they differ in where a reply begins:

- qwen3 (Qwen3, QwQ): inside reasoning when the prompt left a `<think>` open (templates that open it
  for the model, unless `enable_thinking` is false: then the prompt holds `<think>\\n\\n</think>`);
  otherwise the reply is all answer unless it opens `<think>` itself.
- deepseek_r1 (DeepSeek-R1 and its distills): always inside reasoning (R1's template opens `<think>`
  in the prompt; R1-0528 writes the tag again itself), up to `</think>`. A reply without `</think>`
  is all reasoning.

A constrained reply (a JSON schema, a regex, constrained tool calls) begins outside reasoning under
either parser: the grammar governs it from its first token, so it holds reasoning only where the grammar
itself writes `<think>...</think>` at its start. The split of a streamed reply is the split of the whole
reply, wherever the engine's outputs cut the tags. Importable without the chat route (the Responses
route turns the reasoning into "reasoning" output items)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.server.tags import partial_tag

START, END = "<think>", "</think>"
# Prompt tokens looked at for an open <think>: a tag and a newline take at most a few of any vocabulary's
# tokens (one byte each at worst).
PROMPT_TAIL_TOKENS = 16


class ReasoningSplit(NamedTuple):
    reasoning: str  # the reasoning's text (tags left out)
    content: str  # the answer's text


@dataclass(frozen=True)
class Reasoning:
    """How one reply is split: whether it begins inside reasoning (an optional `<think>` at its very
    start opens reasoning either way)."""

    begins_inside: bool

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole reply's (reasoning, content); reasoning None when the reply has none."""
        stream = ReasoningStream(self)
        first, last = stream.feed(text), stream.finish()
        reasoning = first.reasoning + last.reasoning
        return (reasoning if stream.found else None), first.content + last.content


class ReasoningParser:
    """A `--reasoning-parser`: where a reply of a given prompt begins."""

    def __init__(self, begins_inside: bool) -> None:
        self.always_inside = begins_inside

    def for_reply(self, prompt_tail: str, constrained: bool) -> Reasoning:
        """`prompt_tail`: the text of the prompt's last tokens (PROMPT_TAIL_TOKENS)."""
        if constrained:
            return Reasoning(False)
        return Reasoning(self.always_inside or prompt_tail.rfind(START) > prompt_tail.rfind(END))


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser(begins_inside=False),
    "deepseek_r1": ReasoningParser(begins_inside=True),
}


class ReasoningStream:
    """One reply as its text streams: `feed` each piece, `finish` at the end; each returns the new
    reasoning and content. Text that may be the beginning of a tag is held until the next piece tells;
    each character is looked at a bounded number of times."""

    def __init__(self, reasoning: Reasoning) -> None:
        self.state = "start"  # start (an opening <think> may come) -> reasoning -> content
        self.inside = reasoning.begins_inside
        self.held = ""
        self.found = False  # some reasoning was seen: the reply has a reasoning part, maybe empty

    def feed(self, text: str) -> ReasoningSplit:
        self.held += text
        reasoning = content = ""
        if self.state == "start":
            head = self.held.lstrip()
            if head.startswith(START):
                self.held, self.state, self.found = head[len(START) :], "reasoning", True
            elif START.startswith(head):
                return ReasoningSplit("", "")  # only whitespace, or the tag's beginning: wait
            else:
                self.state = "reasoning" if self.inside else "content"
                self.found = self.inside
        if self.state == "reasoning":
            end = self.held.find(END)
            if end < 0:
                keep = partial_tag(self.held, END)
                reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return ReasoningSplit(reasoning, "")
            reasoning, self.held, self.state = self.held[:end], self.held[end + len(END) :], "content"
        content, self.held = self.held, ""
        return ReasoningSplit(reasoning, content)

    def finish(self) -> ReasoningSplit:
        """What was held: reasoning cut before its end tag, or a start that never became a tag."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.inside):
            self.found = True
            return ReasoningSplit(held, "")
        return ReasoningSplit("", held)
