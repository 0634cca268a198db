"""What the model runner asks of a proposer, and the one that fits the configured method."""

from __future__ import annotations

from typing import Protocol

from tokenmill.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    """Guesses the next tokens of the requests that just sampled; the target model verifies them in
    their next step. Sees plain token ids and block tables: nothing of the runner's own state."""

    def propose(
        self,
        req_ids: list[str],
        token_ids: list[list[int]],  # each request's prompt + output, its last token just sampled
        block_ids: list[list[int]],  # each request's KV blocks (a draft model writes its own cache there)
        max_drafts: list[int],  # at most this many drafts for each request (>= 1)
    ) -> list[list[int]]:
        """Drafts per request, each at most its max_drafts long (possibly empty)."""
        ...

    def remove_request(self, req_id: str) -> None:
        """Forget a finished, aborted or preempted request."""
        ...


class NgramLookup:
    """Prompt lookup: each request's drafts continue the latest earlier occurrence of its last n tokens."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.ngram = NgramProposer(num_speculative_tokens, min_n, max_n)

    def propose(
        self, req_ids: list[str], token_ids: list[list[int]], block_ids: list[list[int]], max_drafts: list[int]
    ) -> list[list[int]]:
        return [self.ngram.propose(tokens, n) for tokens, n in zip(token_ids, max_drafts)]

    def remove_request(self, req_id: str) -> None:
        pass  # no per-request state
