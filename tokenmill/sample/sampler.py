"""Logits -> next tokens: bias and penalties, then greedy or temperature / top-k / top-p / min-p
sampling, with per-request seeds that make a request's draws independent of the rest of the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.sample.logprobs import compute_topk_logprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.penalties import apply_penalties


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    # Only when a request asked for logprobs: column 0 is the sampled token, then the top k.
    topk_token_ids: torch.Tensor | None = None  # [num_reqs, k + 1]
    topk_logprobs: torch.Tensor | None = None  # [num_reqs, k + 1]
    sampled_ranks: torch.Tensor | None = None  # [num_reqs] 1-based rank in the raw distribution


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # [num_reqs, vocab_size]
        # Logprobs describe the model's own distribution, before any request-specific processing.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        logits = self._adjust(logits, meta)
        greedy_tokens = logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy_tokens
        else:
            sampled = torch.where(meta.greedy, greedy_tokens, self._sample(logits, meta))
        if raw_logprobs is None or meta.max_num_logprobs is None:
            return SamplerOutput(sampled)
        ids, values, ranks = compute_topk_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, ids, values, ranks)

    @staticmethod
    def _adjust(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.bias_rows is not None and meta.bias_cols is not None and meta.bias_values is not None:
            logits = logits.index_put((meta.bias_rows, meta.bias_cols), meta.bias_values, accumulate=True)
        if meta.prompt_tokens is not None and meta.output_tokens is not None:
            assert meta.repetition_penalty is not None and meta.presence_penalty is not None
            assert meta.frequency_penalty is not None
            logits = apply_penalties(
                logits, meta.prompt_tokens, meta.output_tokens,
                meta.repetition_penalty, meta.presence_penalty, meta.frequency_penalty,
            )
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.top_k is not None or meta.top_p is not None:
            logits = _top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)  # [num_reqs, vocab_size]
        if meta.min_p is not None:
            threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        # Inverse-CDF draw: one uniform per row. A seeded row takes its uniform from its own
        # generator, so its draw ignores its row index and its neighbours.
        uniform = torch.rand(probs.shape[0], device=probs.device)
        for row, gen in enumerate(meta.generators):
            if gen is not None:
                uniform[row] = torch.rand(1, generator=gen, device=probs.device)[0]
        cdf = probs.cumsum(dim=-1)  # [num_reqs, vocab_size]
        targets = (uniform * cdf[:, -1]).unsqueeze(1)  # [num_reqs, 1]
        # right=True: the first token whose cdf exceeds the target, so zero-probability tokens never win.
        return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf everything outside each row's top k and its top-p nucleus (one sort for both)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [num_reqs, vocab_size]
    vocab_size = logits.shape[1]
    if top_k is not None:
        ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the tokens before it already reach top_p (the first is always kept).
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
