"""Tags found in text that streams in pieces: a piece may end with the beginning of a tag."""

from __future__ import annotations


def partial_tag(text: str, tag: str) -> int:
    """How many of `text`'s last characters may be the beginning of `tag` (held back until the next piece)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0
