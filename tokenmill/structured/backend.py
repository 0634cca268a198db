"""What a grammar library provides: compile a spec once, then a matcher per request that fills the
request's row of the step's token bitmask and follows the tokens it samples."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tokenmill.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # hints only: the server checks specs without torch
    import torch


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` ([rows, num_words] int32 on the CPU, one bit
        per token). Once the grammar is complete (or broken), only eos is allowed."""
        ...

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over `token_ids`; False if the grammar rejects one (the matcher then stays broken)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, from the first, the grammar would accept next; changes nothing."""
        ...

    def is_terminated(self) -> bool:
        """Whether the grammar is complete: nothing but eos may follow."""
        ...


class Grammar(Protocol):
    """A compiled spec, shared by every request that uses it."""

    def matcher(self) -> GrammarMatcher:
        """A new matcher at the grammar's start."""
        ...


class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer."""

    @property
    def num_words(self) -> int:
        """int32 words in a bitmask row: one bit for every token of the tokenizer and of the logits."""
        ...

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """Raises ValueError, with the library's message, for a schema, regex or grammar it rejects."""
        ...


class GrammarChecker(Protocol):
    """What a front end needs: whether a spec compiles, without keeping (or, in another process than the
    engine's, even building) the grammar."""

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raises ValueError, with the library's message, for a spec that would not compile."""
        ...
