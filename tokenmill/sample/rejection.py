"""Verification of speculative drafts: which drafts the target keeps, and the one token it adds.

`rejection_sample` keeps the emitted tokens distributed exactly as the target's sampling distribution
p, whatever the draft distribution q (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"): accept draft d with probability min(1, p(d) / q(d)); at the first rejection,
emit a correction drawn from normalize(max(p - q, 0)); when every draft is accepted, emit a bonus token
drawn from p at the row after the last draft. `greedy_verify` is the same walk for greedy requests.

Row layout: request i with drafts d_1..d_k owns k + 1 consecutive rows of the target's distributions:
row j is the target's distribution for the position of d_{j+1}, row k the one after the last draft.
"""

from __future__ import annotations

import torch

from tokenmill.sample.distribution import inverse_cdf


def rejection_sample(
    target_probs: torch.Tensor,  # [num_rows, vocab_size] float32, rows sum to 1; num_rows = sum(k_i + 1)
    draft_token_ids: list[list[int]],  # per request its drafts d_1..d_k (k may be 0)
    draft_probs: torch.Tensor | None,  # [sum(k_i), vocab_size] float32; None: every draft is deterministic
    accept_uniforms: torch.Tensor,  # [sum(k_i)] float64 in [0, 1)
    recover_uniforms: torch.Tensor,  # [num_reqs] float64 in [0, 1)
) -> list[list[int]]:
    """Per request: its accepted drafts, then one more token (the correction at the first rejection,
    or the bonus token when every draft was accepted); so between 1 and k_i + 1 tokens.

    `target_probs` is the target's final sampling distribution (temperature, top-k/p, min-p and
    penalties applied). `draft_probs` is the distribution each draft token was drawn from; None means
    q is one-hot at each draft (n-gram lookup, greedy drafts), so a draft is accepted with probability
    p(d). Draft j is accepted when u_j * q(d_j) < p(d_j): a token the target cannot emit (p(d) = 0) is
    never accepted, and a draft q gave no mass (q(d) = 0) is accepted whenever p(d) > 0. Each request
    draws its correction or bonus token by inverse CDF with its one recover uniform, in float64, so a
    zero-probability token is never drawn. One host sync, at the end."""
    num_reqs = len(draft_token_ids)
    num_drafts = [len(drafts) for drafts in draft_token_ids]
    total_drafts = sum(num_drafts)
    _check_shapes(target_probs, num_drafts, draft_probs, accept_uniforms, recover_uniforms)
    device = target_probs.device

    # Host-side index tensors: the flat draft list, each draft's target row, each request's first row.
    flat_drafts: list[int] = [token for drafts in draft_token_ids for token in drafts]
    row_starts: list[int] = []
    draft_rows: list[int] = []
    start = 0
    for k in num_drafts:
        row_starts.append(start)
        draft_rows.extend(range(start, start + k))
        start += k + 1
    draft_ids = torch.tensor(flat_drafts, dtype=torch.int64).to(device, non_blocking=True)  # [total_drafts]
    rows = torch.tensor(draft_rows, dtype=torch.int64).to(device, non_blocking=True)  # [total_drafts]

    p_draft = target_probs[rows, draft_ids].to(torch.float64)  # [total_drafts]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs[torch.arange(total_drafts, device=device), draft_ids].to(torch.float64)
    # u < p / q without dividing: q = 0 accepts iff p > 0, p = 0 never accepts.
    accepted = accept_uniforms.to(device, torch.float64) * q_draft < p_draft  # [total_drafts] bool
    num_accepted = _leading_true_counts(accepted, num_drafts, device)  # [num_reqs] int64

    num_drafts_t = torch.tensor(num_drafts, dtype=torch.int64).to(device, non_blocking=True)  # [num_reqs]
    starts = torch.tensor(row_starts, dtype=torch.int64).to(device, non_blocking=True)  # [num_reqs]
    rejected = num_accepted < num_drafts_t  # [num_reqs] bool
    # Request i's row r_i = start_i + n_i sits right after its accepted drafts; the rejected draft
    # there (when there is one) is flat draft r_i - i, since request i's rows skip i bonus rows.
    final_rows = starts + num_accepted  # [num_reqs]
    rejected_draft = (final_rows - torch.arange(num_reqs, device=device)).clamp_(0, max(total_drafts - 1, 0))
    p_final = target_probs[final_rows].to(torch.float64)  # [num_reqs, vocab_size]
    dist = _correction_distribution(p_final, rejected, rejected_draft, draft_ids, draft_probs)
    recovered = inverse_cdf(dist, recover_uniforms.to(device, torch.float64))  # [num_reqs] int64

    counts_and_tokens: list[list[int]] = torch.stack([num_accepted, recovered]).tolist()  # the one sync
    return [
        drafts[:n] + [token] for drafts, n, token in zip(draft_token_ids, counts_and_tokens[0], counts_and_tokens[1])
    ]


def greedy_verify(target_argmax: list[int], draft_token_ids: list[list[int]]) -> list[list[int]]:
    """Per request: the drafts while draft j equals the target's argmax at the request's row j, then the
    target's argmax at the first mismatch (or at row k when every draft matched). `target_argmax` holds
    one token per row, request i owning k_i + 1 consecutive rows."""
    if len(target_argmax) != sum(len(drafts) + 1 for drafts in draft_token_ids):
        raise ValueError(
            f"target_argmax has {len(target_argmax)} rows; the drafts need one per draft plus one per request."
        )
    out: list[list[int]] = []
    start = 0
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and drafts[n] == target_argmax[start + n]:
            n += 1
        out.append(drafts[:n] + [target_argmax[start + n]])
        start += len(drafts) + 1
    return out


def _leading_true_counts(accepted: torch.Tensor, num_drafts: list[int], device: torch.device) -> torch.Tensor:
    """Per request, how many of its drafts were accepted before the first rejection, [num_reqs] int64.
    The flat [total_drafts] flags are padded to [num_reqs, max_k] with False, so the cumulative product
    along a row stops at the first rejection or at the request's last draft."""
    max_k = max(num_drafts, default=0)
    pad = len(accepted)  # index of the appended False
    index: list[list[int]] = []
    offset = 0
    for k in num_drafts:
        index.append(list(range(offset, offset + k)) + [pad] * (max_k - k))
        offset += k
    padded_index = torch.tensor(index, dtype=torch.int64).reshape(len(num_drafts), max_k)  # [num_reqs, max_k]
    flags = torch.cat([accepted, accepted.new_zeros(1)])  # [total_drafts + 1] bool
    padded = flags[padded_index.to(device, non_blocking=True)].to(torch.int64)  # [num_reqs, max_k]
    return padded.cumprod(dim=1).sum(dim=1)


def _correction_distribution(
    p_final: torch.Tensor,  # [num_reqs, vocab_size] float64: the target's distribution at each final row
    rejected: torch.Tensor,  # [num_reqs] bool: the final row holds a rejected draft
    rejected_draft: torch.Tensor,  # [num_reqs] int64: flat index of that draft (any valid index where none)
    draft_ids: torch.Tensor,  # [total_drafts] int64
    draft_probs: torch.Tensor | None,  # [total_drafts, vocab_size] float32, or None for one-hot drafts
) -> torch.Tensor:
    """The unnormalized distribution each request draws its last token from, [num_reqs, vocab_size]
    float64: max(p - q, 0) at a rejection, p for the bonus token and where max(p - q, 0) sums to 0
    (p equals q up to rounding, so a rejection there is rounding noise and p is the right answer)."""
    if draft_ids.numel() == 0:
        return p_final
    if draft_probs is None:
        # q one-hot at d: max(p - q, 0) is p with p(d) zeroed (p(d) <= 1).
        token = draft_ids[rejected_draft].unsqueeze(1)  # [num_reqs, 1]
        kept = p_final.gather(1, token) * (~rejected).unsqueeze(1)  # [num_reqs, 1]
        residual = p_final.scatter(1, token, kept)
        use_p = residual.sum(dim=1, keepdim=True) <= 0.0  # [num_reqs, 1]
    else:
        # float32 q against float64 p: the subtraction promotes without a float64 copy of q.
        residual = (p_final - draft_probs[rejected_draft]).clamp_(min=0.0)  # [num_reqs, vocab_size]
        use_p = (residual.sum(dim=1) <= 0.0).logical_or_(~rejected).unsqueeze(1)  # [num_reqs, 1]
    return torch.where(use_p, p_final, residual)


def _check_shapes(
    target_probs: torch.Tensor,
    num_drafts: list[int],
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    recover_uniforms: torch.Tensor,
) -> None:
    total_drafts = sum(num_drafts)
    num_rows = total_drafts + len(num_drafts)
    if target_probs.dim() != 2 or target_probs.shape[0] != num_rows:
        raise ValueError(
            f"target_probs must be [num_rows={num_rows}, vocab_size] (one row per draft plus one per request), "
            f"got {list(target_probs.shape)}."
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [{total_drafts}, {target_probs.shape[1]}] (one row per draft), "
            f"got {list(draft_probs.shape)}."
        )
    if accept_uniforms.shape != (total_drafts,):
        raise ValueError(
            f"accept_uniforms must be [{total_drafts}] (one per draft), got {list(accept_uniforms.shape)}."
        )
    if recover_uniforms.shape != (len(num_drafts),):
        raise ValueError(
            f"recover_uniforms must be [{len(num_drafts)}] (one per request), got {list(recover_uniforms.shape)}."
        )
