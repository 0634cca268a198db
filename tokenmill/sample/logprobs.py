"""Top-k logprobs around a chosen token, for sampled tokens and prompt tokens alike."""

from __future__ import annotations

import torch

from tokenmill.outputs import Logprob, TokenLogprobs


def compute_topk_logprobs(
    logprobs: torch.Tensor,  # [num_tokens, vocab_size] log-softmax of the raw logits
    target_ids: torch.Tensor,  # [num_tokens] int64, the token chosen at each position
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns token ids [num_tokens, k + 1] and their logprobs [num_tokens, k + 1] (column 0 is the
    target, then the k most likely tokens, best first), and the target's 1-based rank [num_tokens]
    in the full distribution (1 + the number of strictly more likely tokens)."""
    if k < 0:
        raise ValueError(f"the number of top logprobs must be >= 0, got {k}.")
    target_ids = target_ids.unsqueeze(1)  # [num_tokens, 1]
    target_logprobs = logprobs.gather(1, target_ids)  # [num_tokens, 1]
    ranks = (logprobs > target_logprobs).sum(dim=1) + 1  # [num_tokens]
    top_logprobs, top_ids = logprobs.topk(k, dim=1)  # [num_tokens, k]
    token_ids = torch.cat([target_ids, top_ids], dim=1)  # [num_tokens, k + 1]
    values = torch.cat([target_logprobs, top_logprobs], dim=1)  # [num_tokens, k + 1]
    return token_ids, values, ranks


def to_token_logprobs(
    token_ids: torch.Tensor,  # [num_tokens, k + 1] from compute_topk_logprobs
    values: torch.Tensor,  # [num_tokens, k + 1]
    ranks: torch.Tensor,  # [num_tokens]
    num_logprobs: list[int] | None = None,
) -> list[TokenLogprobs]:
    """One dict per row: the target with its rank, and the top-k tokens with ranks 1..k (a target that
    is also in the top k appears once, with its own rank). `num_logprobs[i]` keeps only the first
    top entries of row i, for batches where requests asked for different k; default: all k."""
    num_tokens, width = token_ids.shape
    if num_logprobs is not None and (len(num_logprobs) != num_tokens or any(not 0 <= k < width for k in num_logprobs)):
        raise ValueError(
            f"num_logprobs needs one value in [0, {width - 1}] per row ({num_tokens}), got {num_logprobs}."
        )
    rows = zip(token_ids.tolist(), values.tolist(), ranks.tolist())
    out: list[TokenLogprobs] = []
    for i, (row_ids, row_values, rank) in enumerate(rows):
        k = len(row_ids) - 1 if num_logprobs is None else num_logprobs[i]
        entry: TokenLogprobs = {row_ids[0]: Logprob(row_values[0], rank)}
        for j in range(1, k + 1):
            entry.setdefault(row_ids[j], Logprob(row_values[j], j))
        out.append(entry)
    return out
