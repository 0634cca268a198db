"""Logits -> next tokens: logit_bias, penalties and min_tokens masking, then greedy or
temperature / top-k / top-p / min-p sampling, with per-request seeds that make a request's draws
independent of the rest of the batch."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from tokenmill.attention.triton import triton_unavailable_reason
from tokenmill.ops.cpu_ops import cpu_ops
from tokenmill.sample.bitmask import TokenBitmask
from tokenmill.sample.distribution import adjust_logits, filtered_probs, inverse_cdf, row_seeds, row_uniforms
from tokenmill.sample.logprobs import compute_topk_logprobs
from tokenmill.sample.metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    # Only when some request asked for logprobs, with k = SamplingMetadata.max_num_logprobs.
    # Column 0 is the sampled token, then the k most likely tokens of the raw distribution.
    topk_token_ids: torch.Tensor | None = None  # [num_reqs, k + 1] int64
    topk_logprobs: torch.Tensor | None = None  # [num_reqs, k + 1] float32
    sampled_ranks: torch.Tensor | None = None  # [num_reqs] int64, 1-based rank of the sampled token


class Sampler(nn.Module):
    """Picks one token per row. The caller's logits are left unchanged.

    Order: raw logprobs (if asked) -> logit_bias -> penalties -> min_tokens mask -> grammar mask ->
    argmax for greedy rows; temperature -> top-k -> top-p -> min-p -> draw for the others (the
    pipeline is sample/distribution.py's, shared with speculative decoding). Reported
    logprobs describe the model's own distribution (log_softmax of the unmodified logits), as in vLLM and
    HF; under a grammar too (vLLM reports the masked one there): they show what the constraint overrode.
    """

    def forward(
        self, logits: torch.Tensor, meta: SamplingMetadata, bitmask: TokenBitmask | None = None
    ) -> SamplerOutput:
        """`bitmask`: the tokens a grammar allows on its constrained rows (tokenmill.structured)."""
        # [num_reqs, vocab_size] float32, ours to change in place; no copy where nothing below writes
        # to it (greedy or a plain CPU draw, no bias, penalties, min_tokens or grammar: the common case).
        if logits.dtype != torch.float32 or bitmask is not None or not _read_only(logits, meta):
            logits = logits.to(torch.float32, copy=True)
        k = meta.max_num_logprobs
        raw_logprobs = logits.log_softmax(dim=-1) if k is not None else None  # [num_reqs, vocab_size]
        adjust_logits(logits, meta, bitmask)
        sampled = _pick(logits, meta)  # [num_reqs]
        if raw_logprobs is None or k is None:
            return SamplerOutput(sampled)
        token_ids, values, ranks = compute_topk_logprobs(raw_logprobs, sampled, k)
        return SamplerOutput(sampled, token_ids, values, ranks)


def _read_only(logits: torch.Tensor, meta: SamplingMetadata) -> bool:
    """Whether sampling these float32 logits leaves them unchanged."""
    unadjusted = meta.no_logit_bias and meta.no_penalties and meta.no_min_tokens
    one_pass = _cpu_draw(logits, meta) is not None or (_unfiltered(meta) and use_triton_draw(logits))
    return unadjusted and (meta.all_greedy or one_pass)


def _unfiltered(meta: SamplingMetadata) -> bool:
    return meta.no_top_k and meta.no_top_p and meta.no_min_p


def use_triton_draw(logits: torch.Tensor) -> bool:
    """Whether the draw runs the Triton kernel (sample/triton_sample.py): on CUDA, where triton imports."""
    return logits.is_cuda and triton_unavailable_reason() is None


def _cpu_draw(logits: torch.Tensor, meta: SamplingMetadata) -> ModuleType | None:
    """The C++ ops when they can draw these rows (a plain temperature draw on CPU), else None."""
    # With no filter, filtered_probs is softmax(logits / temperature): the C++ draw is that softmax's
    # inverse CDF in one pass.
    if not (_unfiltered(meta) and logits.is_contiguous()):
        return None
    return cpu_ops(logits)


def _pick(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.no_greedy:
        return _sample(logits, meta)
    ops = cpu_ops(logits) if logits.is_contiguous() else None
    greedy_ids = ops.argmax_rows(logits) if ops is not None else logits.argmax(dim=-1)  # [num_reqs]
    if meta.all_greedy:
        return greedy_ids
    return torch.where(meta.greedy, greedy_ids, _sample(logits, meta))


def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Draws one token per row from filtered_probs (the filtered softmax(logits / temperature)). On CUDA
    with triton, one pass per row in a kernel that makes its noise as it goes (_triton_draw); elsewhere
    inverse CDF with one uniform per row: a vocab-wide noise row per step costs more than the rest of
    sampling. The torch path and a filtered Triton draw change `logits`, the C++ draw and an unfiltered
    Triton draw do not."""
    if use_triton_draw(logits):
        return _triton_draw(logits, meta)
    uniform = row_uniforms(meta, logits.shape[0], logits.device)  # [num_reqs] float64
    ops = _cpu_draw(logits, meta)
    if ops is not None:  # one pass per row in C++, no [num_reqs, vocab_size] temporaries
        sampled: torch.Tensor = ops.sample_rows(logits, meta.temperature, uniform)  # [num_reqs] int64
        return sampled
    return inverse_cdf(filtered_probs(logits, meta), uniform)


def _triton_draw(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[num_reqs] int64, keyed by row_seeds: no float64 cumulative sum, no loop over generators. With no
    filter the kernel reads the logits and temperatures as they are; otherwise it races the filtered
    probabilities."""
    from tokenmill.sample import triton_sample  # imports triton: only once a draw needs it

    seeds = row_seeds(meta, logits.shape[0], logits.device)  # [num_reqs] int64
    if _unfiltered(meta):
        return triton_sample.sample_logits(logits, meta.temperature, seeds)
    return triton_sample.sample_probs(filtered_probs(logits, meta), seeds)
