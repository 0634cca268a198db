"""The text shown beside a logprob: `tokenizer.decode([token_id])`, decoded once per tokenizer and id.

Echo with logprobs returns k + 1 entries for every prompt position, on the server's event loop: one
tokenizer call each would dominate it. A single id's text depends on nothing but the id, so each
tokenizer keeps a table of the ids it has seen, bounded by the vocabulary (a few MB at 150k tokens),
and every later lookup is a dict hit."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenTexts(dict[int, str]):
    """token id -> its text, each decoded on first use."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__()
        # Weak: a strong reference from the value would keep its entry in _TABLES alive forever.
        self._tokenizer = weakref.ref(tokenizer)

    def __missing__(self, token_id: int) -> str:
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer of this token table is gone; get one from token_texts().")
        # One id decodes to one string (decode() is typed for batches too).
        text = self[token_id] = cast(str, tokenizer.decode([token_id]))
        return text


# One table per tokenizer, dropped with it.
_TABLES: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, TokenTexts] = weakref.WeakKeyDictionary()


def token_texts(tokenizer: PreTrainedTokenizerBase) -> TokenTexts:
    """The shared table of `tokenizer`: `token_texts(tok)[i] == tok.decode([i])`."""
    table = _TABLES.get(tokenizer)
    if table is None:
        table = _TABLES[tokenizer] = TokenTexts(tokenizer)
    return table
