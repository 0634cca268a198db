"""A tool call's JSON as the model wrote it: `{"name": ..., "arguments" (or "parameters"): {...}}`. A
call's arguments are the arguments object's own text, cut out of the output, not parsed and written
again: so the pieces streamed as the model writes them (tool_stream.py) add up to exactly the
arguments of the finished reply."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999: Python and JavaScript clients would read infinity
        raise ValueError("a number too large for a double")
    return value


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)
ARGUMENT_KEYS = ("arguments", "parameters")
NO_ARGUMENTS_TEXT = "{}"


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def arguments_text(text: str) -> str | None:
    """`text` stripped, if it is one JSON object, else None."""
    text = text.strip()
    try:
        return text if isinstance(DECODER.decode(text), dict) else None
    except (ValueError, RecursionError):
        return None


def call_from_text(text: str) -> ParsedCall | None:
    """One call object's text as a call; None unless it is an object with a string "name" and arguments
    that are an object (or a string holding one's JSON). No arguments: "{}"."""
    try:
        members = _members(text)
        if members is None or "name" not in members:
            return None
        name = DECODER.decode(text[slice(*members["name"])])
    except (ValueError, RecursionError):
        return None
    if not isinstance(name, str):
        return None
    key = next((k for k in ARGUMENT_KEYS if k in members), None)
    if key is None:
        return ParsedCall(name, NO_ARGUMENTS_TEXT)
    arguments = text[slice(*members[key])]
    if arguments.startswith('"'):
        arguments = json.loads(arguments)  # a string's JSON text: decoded when it was a member
    found = arguments_text(arguments)
    return None if found is None else ParsedCall(name, found)


def array_items(text: str) -> list[str] | None:
    """The texts of a JSON array's items; None unless `text` is one non-empty array."""
    pos = skip_space(text, 0)
    if not text.startswith("[", pos):
        return None
    pos = skip_space(text, pos + 1)
    items: list[str] = []
    try:
        while True:
            _, end = DECODER.raw_decode(text, pos)
            items.append(text[pos:end])
            pos = skip_space(text, end)
            if text.startswith(",", pos):
                pos = skip_space(text, pos + 1)
            elif text.startswith("]", pos) and skip_space(text, pos + 1) == len(text):
                return items
            else:
                return None
    except (ValueError, RecursionError):
        return None


def _members(text: str) -> dict[str, tuple[int, int]] | None:
    """Each top-level key of an object's text -> where its value's text starts and ends; None unless
    `text` is one object. ValueError for JSON that does not parse."""
    pos = skip_space(text, 0)
    if not text.startswith("{", pos):
        return None
    pos = skip_space(text, pos + 1)
    spans: dict[str, tuple[int, int]] = {}
    if text.startswith("}", pos):
        return spans if skip_space(text, pos + 1) == len(text) else None
    while text.startswith('"', pos):
        key, pos = DECODER.raw_decode(text, pos)
        pos = skip_space(text, pos)
        if not text.startswith(":", pos):
            return None
        start = skip_space(text, pos + 1)
        _, end = DECODER.raw_decode(text, start)
        spans[key] = (start, end)
        pos = skip_space(text, end)
        if text.startswith(",", pos):
            pos = skip_space(text, pos + 1)
        elif text.startswith("}", pos):
            return spans if skip_space(text, pos + 1) == len(text) else None
        else:
            return None
    return None
