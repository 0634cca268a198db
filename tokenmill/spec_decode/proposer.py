"""What the model runner asks of a proposer, and the one that fits the configured method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.ngram import NgramProposer


@dataclass
class Proposal:
    drafts: list[list[int]]  # per request, at most its max_drafts tokens (possibly none)
    # Per request, the distribution each draft was drawn from, [len(drafts), vocab_size] float32; None
    # for guesses without one (n-gram lookup, greedy drafts): the verifier takes them as one-hot.
    probs: list[torch.Tensor | None]


class Proposer(Protocol):
    """Guesses the next tokens of the requests that just sampled; the target model verifies them in
    their next step. Sees plain token ids and block tables: nothing of the runner's own state."""

    def propose(
        self,
        req_ids: list[str],
        token_ids: list[list[int]],  # each request's prompt + output, its last token just sampled
        block_ids: list[list[int]],  # each request's KV blocks (a draft model writes its own cache there)
        max_drafts: list[int],  # at most this many drafts for each request (>= 1)
        params: list[SamplingParams],  # each request's sampling (a draft model samples like it)
    ) -> Proposal: ...

    def remove_request(self, req_id: str) -> None:
        """Forget a finished, aborted or preempted request."""
        ...


class NgramLookup:
    """Prompt lookup: each request's drafts continue the latest earlier occurrence of its last n tokens."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.ngram = NgramProposer(num_speculative_tokens, min_n, max_n)

    def propose(
        self,
        req_ids: list[str],
        token_ids: list[list[int]],
        block_ids: list[list[int]],
        max_drafts: list[int],
        params: list[SamplingParams],
    ) -> Proposal:
        drafts = [self.ngram.propose(tokens, n) for tokens, n in zip(token_ids, max_drafts)]
        return Proposal(drafts, [None] * len(drafts))

    def remove_request(self, req_id: str) -> None:
        pass  # no per-request state
