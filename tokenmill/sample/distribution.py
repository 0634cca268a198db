"""The one definition of the distribution a row samples from: logits and the row's settings in,
processed logits or probabilities out. The sampler draws from it; speculative decoding weighs drafts
against it (the target's p) and draws its drafts from it (a draft model's q), so a change made here
reaches all three and the rejection sampler stays exact.

Order: logit_bias -> penalties -> min_tokens mask -> grammar mask (adjust_logits), then temperature ->
top-k -> top-p -> softmax -> min-p (filtered_probs). Greedy rows take the argmax of the adjusted logits.
"""

from __future__ import annotations

import torch

from tokenmill.attention.triton import triton_unavailable_reason
from tokenmill.sample.bitmask import TokenBitmask, apply_token_bitmask
from tokenmill.sample.metadata import SamplingMetadata, to_device
from tokenmill.sample.penalties import apply_logit_bias, apply_penalties, mask_tokens

# Candidates per row for top-k / top-p: the nucleus of a sampled LLM's distribution is nearly always far
# smaller, and a top-k of this many costs a fraction of sorting the whole vocabulary.
TOP_CANDIDATES = 256


def adjust_logits(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32, changed in place
    meta: SamplingMetadata,
    bitmask: TokenBitmask | None = None,
) -> None:
    """logit_bias, penalties, the min_tokens mask, then the grammar's mask: the last masks come last, so
    no bias or penalty can lift a banned token back from -inf."""
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
    if not meta.no_min_tokens:
        mask_tokens(logits, meta.min_tokens_rows, meta.min_tokens_token_ids)
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)


def filtered_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[num_reqs, vocab_size] float32, rows summing to 1: softmax(logits / temperature) restricted to
    the row's top-k, then its top-p nucleus, then the tokens of at least min_p times the most likely
    one's probability, renormalized. `logits` ([num_reqs, vocab_size] float32) is scaled and masked in
    place. Greedy rows (temperature 1, no filters) come out as the plain softmax."""
    logits /= meta.temperature.unsqueeze(1)
    if not (meta.no_top_k and meta.no_top_p):
        _apply_top_k_top_p(logits, None if meta.no_top_k else meta.top_k, None if meta.no_top_p else meta.top_p)
    probs = logits.softmax(dim=-1)  # [num_reqs, vocab_size]
    if not meta.no_min_p:
        threshold = meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
        probs.masked_fill_(probs < threshold, 0.0)
        probs /= probs.sum(dim=-1, keepdim=True)
    return probs


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata, bitmask: TokenBitmask | None = None) -> torch.Tensor:
    """[num_reqs, vocab_size] float32: the distribution each row of Sampler draws from, one-hot at the
    argmax on greedy rows. The caller's logits are left unchanged."""
    logits = logits.to(torch.float32, copy=True)
    adjust_logits(logits, meta, bitmask)
    greedy_ids = logits.argmax(dim=-1)  # [num_reqs]
    probs = filtered_probs(logits, meta)
    if not meta.no_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, greedy_ids.unsqueeze(1), 1.0)
        probs = torch.where(meta.greedy.unsqueeze(1), one_hot, probs)
    return probs


def inverse_cdf(
    dist: torch.Tensor,  # [num_reqs, vocab_size], unnormalized, nonnegative
    uniforms: torch.Tensor,  # [num_reqs] float64 in [0, 1)
) -> torch.Tensor:
    """One token per row, [num_reqs] int64: the first whose cumulative probability exceeds the uniform
    times the row's total (right=True), so a zero-probability token (a flat step of the cdf) never wins.
    The sum runs in float64, exact enough over a whole vocabulary."""
    cdf = dist.to(torch.float64, copy=True).cumsum_(dim=-1)  # [num_reqs, vocab_size]
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)  # [num_reqs, 1]
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=dist.shape[1] - 1)


def row_uniforms(meta: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """One uniform per row for inverse_cdf, [num_rows] float64. A seeded row takes its uniform from its
    own generator, so its draw depends on neither its row index nor its neighbours."""
    uniform = torch.rand(num_rows, dtype=torch.float64, device=device)
    for row, generator in meta.generators.items():
        uniform[row] = torch.rand(1, dtype=torch.float64, generator=generator, device=device)[0]
    return uniform


def row_seeds(meta: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """One Philox key per row for the one-pass draw (sample/triton_sample.py), [num_rows] int64. A seeded
    row's key is its generator's seed, which the runner sets from the request's seed and position
    (RunnerRequestState.position_seed) before each step: its draw then depends on neither its row index
    nor its neighbours. The other rows take fresh keys from torch's default generator."""
    seeds = torch.empty(num_rows, dtype=torch.int64, device=device).random_()  # [num_rows], in [0, 2^63)
    if meta.generators:
        # A generator's seed is a uint64: the same 64 bits as an int64.
        pairs = [[row, _as_int64(gen.initial_seed())] for row, gen in meta.generators.items()]
        rows_and_seeds = to_device(pairs, torch.int64, device)  # [num_seeded, 2]
        seeds.index_copy_(0, rows_and_seeds[:, 0], rows_and_seeds[:, 1])
    return seeds


def _as_int64(seed: int) -> int:
    return seed - 2**64 if seed >= 2**63 else seed


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [num_reqs, vocab_size], masked in place
    top_k: torch.Tensor | None,  # [num_reqs] int64, vocab_size where disabled
    top_p: torch.Tensor | None,  # [num_reqs] float32, 1.0 where disabled
    sync_free: bool | None = None,
) -> None:
    """Masks to -inf every token outside the row's k most likely, then outside the smallest set of
    the remaining (renormalized) tokens whose probability reaches top_p: a token stays while the mass
    of the tokens more likely than it is below top_p.

    Rows are filtered among their TOP_CANDIDATES most likely tokens where those hold the whole answer
    (top_k within them, or a nucleus they cover); the others sort the whole row
    (_apply_top_k_top_p_sorted). Choosing those rows on the host waits for the device: on CUDA with triton
    (`sync_free`, default: there) the masks are applied to every row on the device instead, and the
    others take a threshold found there (_mask_on_device)."""
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
    if sync_free if sync_free is not None else (logits.is_cuda and triton_unavailable_reason() is None):
        _mask_on_device(logits, here, full, indices, values.masked_fill(~keep, float("-inf")), row_k, row_p)
        return
    if bool(here.any()):
        masked = torch.full_like(logits[here], float("-inf"))
        masked.scatter_(1, indices[here], values[here].masked_fill(~keep[here], float("-inf")))
        logits[here] = masked
    if bool(full.any()):
        rows = logits[full]
        _apply_top_k_top_p_sorted(rows, None if top_k is None else top_k[full], None if top_p is None else top_p[full])
        logits[full] = rows


def _mask_on_device(
    logits: torch.Tensor,  # [num_reqs, vocab_size], masked in place
    here: torch.Tensor,  # [num_reqs] bool: rows their candidates answer
    full: torch.Tensor,  # [num_reqs] bool: rows whose filter reaches past the candidates
    indices: torch.Tensor,  # [num_reqs, k] the candidates' token ids
    kept: torch.Tensor,  # [num_reqs, k] the candidates' logits, -inf where filtered out
    top_k: torch.Tensor,  # [num_reqs] int64
    top_p: torch.Tensor,  # [num_reqs] float32
) -> None:
    """_apply_top_k_top_p without a host sync: no boolean indexing, every row through the same ops."""
    from tokenmill.sample.triton_nucleus import nucleus_thresholds  # imports triton

    thresholds = nucleus_thresholds(logits, top_k, top_p, full)  # [num_reqs], -inf outside `full`
    logits.masked_fill_(here.unsqueeze(1), float("-inf"))
    # The candidates' logits back: kept ones on `here` rows, all of them (unchanged) on the others.
    logits.scatter_(1, indices, torch.where(here.unsqueeze(1), kept, logits.gather(1, indices)))
    logits.masked_fill_(logits < thresholds.unsqueeze(1), float("-inf"))


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
