"""Logits -> next tokens: logit_bias, penalties and min_tokens masking, then greedy or
temperature / top-k / top-p / min-p sampling, with per-request seeds that make a request's draws
independent of the rest of the batch."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from tokenmill.ops.cpu_ops import cpu_ops
from tokenmill.sample.bitmask import TokenBitmask, apply_token_bitmask
from tokenmill.sample.logprobs import compute_topk_logprobs
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.penalties import apply_logit_bias, apply_penalties, mask_tokens


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
    argmax for greedy rows; temperature -> top-k -> top-p -> min-p -> draw for the others. Reported
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
        _apply_request_adjustments(logits, meta)
        if bitmask is not None:  # last, so no bias or penalty can lift a token the grammar bans
            apply_token_bitmask(logits, bitmask)
        sampled = _pick(logits, meta)  # [num_reqs]
        if raw_logprobs is None or k is None:
            return SamplerOutput(sampled)
        token_ids, values, ranks = compute_topk_logprobs(raw_logprobs, sampled, k)
        return SamplerOutput(sampled, token_ids, values, ranks)


def _read_only(logits: torch.Tensor, meta: SamplingMetadata) -> bool:
    """Whether sampling these float32 logits leaves them unchanged."""
    unadjusted = meta.no_logit_bias and meta.no_penalties and meta.no_min_tokens
    return unadjusted and (meta.all_greedy or _cpu_draw(logits, meta) is not None)


def _cpu_draw(logits: torch.Tensor, meta: SamplingMetadata) -> ModuleType | None:
    """The C++ ops when they can draw these rows (a plain temperature draw on CPU), else None."""
    if not (meta.no_top_k and meta.no_top_p and meta.no_min_p and logits.is_contiguous()):
        return None
    return cpu_ops(logits)


def _apply_request_adjustments(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    if not meta.no_logit_bias:
        apply_logit_bias(logits, meta.bias_rows, meta.bias_token_ids, meta.bias_values)
    if not meta.no_penalties:
        apply_penalties(
            logits,
            meta.prompt_token_ids,
            meta.output_token_ids,
            meta.repetition_penalty,
            meta.presence_penalty,
            meta.frequency_penalty,
        )
    # Last, so no bias or penalty can lift a banned token back from -inf.
    if not meta.no_min_tokens:
        mask_tokens(logits, meta.min_tokens_rows, meta.min_tokens_token_ids)


def _pick(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.no_greedy:
        return _sample(logits, meta)
    ops = cpu_ops(logits) if logits.is_contiguous() else None
    greedy_ids = ops.argmax_rows(logits) if ops is not None else logits.argmax(dim=-1)  # [num_reqs]
    if meta.all_greedy:
        return greedy_ids
    return torch.where(meta.greedy, greedy_ids, _sample(logits, meta))


def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Draws one token per row from the filtered softmax(logits / temperature); the torch path
    changes `logits`, the C++ draw does not.

    Inverse CDF with one uniform per row (a vocab-wide noise row per step costs more than the rest of
    sampling): the first token whose cumulative probability exceeds the uniform times the total, so a
    zero-probability token (a flat step of the cdf) can never win."""
    uniform = _uniforms(meta, logits.shape[0], logits.device)  # [num_reqs] float64
    ops = _cpu_draw(logits, meta)
    if ops is not None:  # one pass per row in C++, no [num_reqs, vocab_size] temporaries
        sampled: torch.Tensor = ops.sample_rows(logits, meta.temperature, uniform)  # [num_reqs] int64
        return sampled
    logits /= meta.temperature.unsqueeze(1)
    if not (meta.no_top_k and meta.no_top_p):
        _apply_top_k_top_p(logits, None if meta.no_top_k else meta.top_k, None if meta.no_top_p else meta.top_p)
    probs = logits.softmax(dim=-1)  # [num_reqs, vocab_size]
    if not meta.no_min_p:
        threshold = meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
        probs.masked_fill_(probs < threshold, 0.0)
    # float64 keeps the cumulative sum exact enough; right=True picks the first token whose cdf
    # exceeds the target.
    cdf = probs.to(torch.float64).cumsum_(dim=-1)  # [num_reqs, vocab_size]
    targets = (uniform * cdf[:, -1]).unsqueeze(1)  # [num_reqs, 1]
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _uniforms(meta: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """One uniform per row, [num_rows] float64. A seeded row takes its uniform from its own generator,
    so its draw depends on neither its row index nor its neighbours."""
    uniform = torch.rand(num_rows, dtype=torch.float64, device=device)
    for row, generator in meta.generators.items():
        uniform[row] = torch.rand(1, dtype=torch.float64, generator=generator, device=device)[0]
    return uniform


# Candidates per row for top-k / top-p: the nucleus of a sampled LLM's distribution is nearly always far
# smaller, and a top-k of this many costs a fraction of sorting the whole vocabulary.
TOP_CANDIDATES = 256


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [num_reqs, vocab_size], masked in place
    top_k: torch.Tensor | None,  # [num_reqs] int64, vocab_size where disabled
    top_p: torch.Tensor | None,  # [num_reqs] float32, 1.0 where disabled
) -> None:
    """Masks to -inf every token outside the row's k most likely, then outside the smallest set of
    the remaining (renormalized) tokens whose probability reaches top_p: a token stays while the mass
    of the tokens more likely than it is below top_p.

    Rows are filtered among their TOP_CANDIDATES most likely tokens where those hold the whole answer
    (top_k within them, or a nucleus they cover); the others sort the whole row
    (_apply_top_k_top_p_sorted)."""
    num_reqs, vocab_size = logits.shape
    k = min(TOP_CANDIDATES, vocab_size)
    values, indices = logits.topk(k, dim=-1)  # [num_reqs, k], most likely first
    ranks = torch.arange(k, device=logits.device).unsqueeze(0)  # [1, k]
    row_k = top_k if top_k is not None else torch.full((num_reqs,), vocab_size, device=logits.device)
    row_p = top_p if top_p is not None else torch.ones(num_reqs, device=logits.device)
    keep = ranks < row_k.unsqueeze(1)  # [num_reqs, k]
    k_inside = row_k <= k  # [num_reqs]: the top-k set lies among the candidates
    nucleus = row_p < 1.0
    kept_values = values.masked_fill(~keep, float("-inf"))
    # The normalizer: over the top-k set where it lies among the candidates, else the whole row.
    log_total = torch.where(k_inside, kept_values.logsumexp(dim=-1), logits.logsumexp(dim=-1))  # [num_reqs]
    probs = (kept_values - log_total.unsqueeze(1)).exp()  # [num_reqs, k]
    above = probs.cumsum(dim=-1) - probs  # the mass of the more likely candidates
    keep &= (above < row_p.unsqueeze(1)) | (ranks == 0) | ~nucleus.unsqueeze(1)
    covered = probs.sum(dim=-1) >= row_p  # the nucleus ends among the candidates
    # Rows answered by their candidates (a top-k past them would change the nucleus' normalizer).
    here = (nucleus & covered & (k_inside | (row_k >= vocab_size))) | (~nucleus & k_inside)
    untouched = ~nucleus & (row_k >= vocab_size)  # neither filter applies
    full = ~(here | untouched)
    if bool(here.any()):
        masked = torch.full_like(logits[here], float("-inf"))
        masked.scatter_(1, indices[here], values[here].masked_fill(~keep[here], float("-inf")))
        logits[here] = masked
    if bool(full.any()):
        rows = logits[full]
        _apply_top_k_top_p_sorted(rows, None if top_k is None else top_k[full], None if top_p is None else top_p[full])
        logits[full] = rows


def _apply_top_k_top_p_sorted(
    logits: torch.Tensor,  # [num_reqs, vocab_size], masked in place
    top_k: torch.Tensor | None,  # [num_reqs] int64, vocab_size where disabled
    top_p: torch.Tensor | None,  # [num_reqs] float32, 1.0 where disabled
) -> None:
    """_apply_top_k_top_p over the whole sorted row. One ascending sort serves both filters."""
    sorted_logits, order = logits.sort(dim=-1)  # [num_reqs, vocab_size], ascending
    vocab_size = logits.shape[1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)  # [num_reqs, vocab_size], in sorted order
    if top_k is not None:
        positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, vocab_size]
        drop |= positions < (vocab_size - top_k).unsqueeze(1)
        sorted_logits.masked_fill_(drop, float("-inf"))
    if top_p is not None:
        # Ascending cumsum = the mass of a token and everything less likely. Dropping while that mass
        # is <= 1 - top_p keeps the nucleus; top_p = 1 then drops only zero-probability tokens,
        # whatever the rounding of the sum.
        mass_at_or_below = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [num_reqs, vocab_size]
        nucleus_drop = mass_at_or_below <= (1.0 - top_p).unsqueeze(1)
        nucleus_drop[:, -1] = False  # the most likely token always stays
        drop |= nucleus_drop
    logits.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata, bitmask: TokenBitmask | None = None) -> torch.Tensor:
    """[num_reqs, vocab_size] float32: the distribution each row draws from, the same processing as
    Sampler (logit_bias, penalties, min_tokens, grammar, temperature, top-k, top-p, min-p); one-hot at
    the argmax on greedy rows. Speculative decoding's rejection sampler weighs drafts against it."""
    logits = logits.to(torch.float32, copy=True)
    _apply_request_adjustments(logits, meta)
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)
    greedy_ids = logits.argmax(dim=-1)  # [num_reqs]
    logits /= meta.temperature.unsqueeze(1)
    if not (meta.no_top_k and meta.no_top_p):
        _apply_top_k_top_p(logits, None if meta.no_top_k else meta.top_k, None if meta.no_top_p else meta.top_p)
    probs = logits.softmax(dim=-1)  # [num_reqs, vocab_size]
    if not meta.no_min_p:
        threshold = meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
        probs.masked_fill_(probs < threshold, 0.0)
        probs /= probs.sum(dim=-1, keepdim=True)
    if not meta.no_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, greedy_ids.unsqueeze(1), 1.0)
        probs = torch.where(meta.greedy.unsqueeze(1), one_hot, probs)
    return probs
