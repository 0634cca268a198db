"""The `copy-edit` workload's tasks: chat requests whose answers copy most of their prompt, where
speculative decoding is meant to help (prompt lookup finds the answer's next tokens in the prompt).

Four kinds, in turn: repeat a text exactly; correct the typos injected into a paragraph; rename a
variable in a piece of Python; convert a paragraph to one sentence per line, or a list to a numbered
list, a JSON array or a Markdown table. The texts ship with tokenmill (data/copy_edit.txt); a seeded
generator picks them and the edits, so a seed gives the same tasks every run.

    tasks = copy_edit_tasks(np.random.default_rng(0), 16)
    tasks[0].prompt, tasks[0].answer  # the user's message, and the text a perfect reply writes
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np

KINDS = ("repeat", "typos", "rename", "convert")
# Names a renamed variable may take (one the snippet does not use already).
NEW_NAMES = ("accumulator", "current_item", "temp_value", "entry", "bucket", "cursor", "payload", "holder")
# Typos per corrected paragraph, drawn in [MIN_TYPOS, MAX_TYPOS].
MIN_TYPOS, MAX_TYPOS = 3, 6


@dataclass(frozen=True)
class ChatTask:
    kind: str  # one of KINDS
    prompt: str  # the user's message: the instruction, then the text to copy
    answer: str  # what a perfect reply writes: the text, edited


@dataclass(frozen=True)
class Sources:
    prose: list[str]
    code: list[str]
    lists: list[list[str]]


@cache
def load_sources() -> Sources:
    """The texts of data/copy_edit.txt, read through importlib.resources so an installed wheel has them."""
    text = resources.files("tokenmill.bench").joinpath("data/copy_edit.txt").read_text(encoding="utf-8")
    prose: list[str] = []
    code: list[str] = []
    lists: list[list[str]] = []
    for section in re.split(r"^=== ", text, flags=re.MULTILINE)[1:]:
        kind, _, body = section.partition("\n")
        body = body.strip("\n")
        if kind == "prose":
            prose.append(body)
        elif kind == "code":
            code.append(body)
        elif kind == "list":
            lists.append(body.splitlines())
        else:
            raise ValueError(f"copy_edit.txt: unknown section {kind!r}")
    return Sources(prose, code, lists)


def copy_edit_tasks(rng: np.random.Generator, n: int) -> list[ChatTask]:
    """`n` tasks, the kinds in turn, their texts and edits drawn from `rng`."""
    decks = _Decks(rng, load_sources())
    makers = {"repeat": _repeat, "typos": _typos, "rename": _rename, "convert": _convert}
    return [makers[KINDS[i % len(KINDS)]](rng, decks) for i in range(n)]


class _Decks:
    """The sources, each kind dealt in a shuffled order and reshuffled when used up: texts repeat only
    after all have been dealt, so few requests share a whole prompt (which the prefix cache would serve)."""

    def __init__(self, rng: np.random.Generator, sources: Sources) -> None:
        self.rng, self.sources = rng, sources
        self._order: dict[str, list[int]] = {"prose": [], "code": [], "lists": []}

    def _deal(self, kind: str, size: int) -> int:
        order = self._order[kind]
        if not order:
            order.extend(self.rng.permutation(size).tolist())
        return order.pop()

    def prose(self) -> str:
        return self.sources.prose[self._deal("prose", len(self.sources.prose))]

    def code(self) -> str:
        return self.sources.code[self._deal("code", len(self.sources.code))]

    def items(self) -> list[str]:
        return self.sources.lists[self._deal("lists", len(self.sources.lists))]


def _pick(rng: np.random.Generator, items: list[str]) -> str:
    return items[int(rng.integers(len(items)))]


def _repeat(rng: np.random.Generator, decks: _Decks) -> ChatTask:
    if rng.random() < 0.5:
        text = decks.prose()
        return ChatTask("repeat", f"Repeat the following text exactly, without any other words.\n\n{text}", text)
    code = f"```python\n{decks.code()}\n```"
    return ChatTask("repeat", f"Repeat the following code exactly, without any other words.\n\n{code}", code)


def _typos(rng: np.random.Generator, decks: _Decks) -> ChatTask:
    text = decks.prose()
    prompt = "Correct the typos in the following text. Reply with the corrected text only.\n\n"
    return ChatTask("typos", prompt + inject_typos(rng, text), text)


def inject_typos(rng: np.random.Generator, text: str) -> str:
    """`text` with a few words of four letters or more misspelt: two inner letters swapped, a letter
    dropped, or a letter doubled."""
    words = list(re.finditer(r"[A-Za-z]{4,}", text))
    count = min(len(words), int(rng.integers(MIN_TYPOS, MAX_TYPOS + 1)))
    chosen = sorted(rng.choice(len(words), size=count, replace=False).tolist(), reverse=True)
    for index in chosen:  # from the end, so earlier spans stay valid
        match = words[index]
        text = text[: match.start()] + _misspell(rng, match.group()) + text[match.end() :]
    return text


def _misspell(rng: np.random.Generator, word: str) -> str:
    i = int(rng.integers(1, len(word) - 2))  # an inner position: the word stays recognisable
    edit = int(rng.integers(3))
    if edit == 0 and word[i] != word[i + 1]:
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if edit == 1:
        return word[:i] + word[i + 1 :]
    return word[:i] + word[i] + word[i:]


def _rename(rng: np.random.Generator, decks: _Decks) -> ChatTask:
    code = decks.code()
    old = _pick(rng, renamable_names(code))
    new = _pick(rng, [name for name in NEW_NAMES if not re.search(rf"\b{name}\b", code)])
    prompt = (
        f"Rename the variable `{old}` to `{new}` in this Python code. Reply with the whole code only.\n\n"
        f"```python\n{code}\n```"
    )
    return ChatTask("rename", prompt, f"```python\n{rename(code, old, new)}\n```")


def renamable_names(code: str) -> list[str]:
    """Variables and parameters of `code` that a textual rename changes safely: not `self`, never a
    keyword argument's name, and never inside a string (f-strings tokenize differently across Python
    versions, so the answer would too)."""
    tree = ast.parse(code)
    strings = [
        ast.get_source_segment(code, node) or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))
    ]
    keywords = {node.arg for node in ast.walk(tree) if isinstance(node, ast.keyword)}
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    names |= {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    return sorted(
        name for name in names - keywords - {"self"} if not any(re.search(rf"\b{name}\b", s) for s in strings)
    )


def rename(code: str, old: str, new: str) -> str:
    """Every `old` that is a whole name and not an attribute (`.old`) becomes `new`."""
    return re.sub(rf"(?<![\w.]){re.escape(old)}\b", new, code)


def _convert(rng: np.random.Generator, decks: _Decks) -> ChatTask:
    if rng.random() < 0.5:
        text = decks.prose()
        sentences = re.split(r"(?<=[.!?])\s+", text)
        prompt = (
            "Convert the following text to a bulleted list with one sentence per line, keeping every "
            f"sentence word for word.\n\n{text}"
        )
        return ChatTask("convert", prompt, "\n".join(f"- {s}" for s in sentences))
    items = decks.items()
    listing = "\n".join(f"- {item}" for item in items)
    target = int(rng.integers(3))
    if target == 0:
        what, answer = "a numbered list", "\n".join(f"{i}. {item}" for i, item in enumerate(items, 1))
    elif target == 1:
        what, answer = "a JSON array of strings", json.dumps(items, indent=2)
    else:
        what = 'a Markdown table with one column, "Item"'
        answer = "\n".join(["| Item |", "| --- |"] + [f"| {item} |" for item in items])
    return ChatTask("convert", f"Convert this list to {what}. Reply with the result only.\n\n{listing}", answer)
