"""Top-k logprobs of chosen tokens, for sampled tokens and for prompt tokens alike."""

from __future__ import annotations

import torch

from tokenmill.outputs import Logprob, TokenLogprobs


def compute_topk_logprobs(
    logprobs: torch.Tensor,  # [num_tokens, vocab_size] log-softmax of the raw logits
    target_ids: torch.Tensor,  # [num_tokens] the token actually chosen at each position
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ids [n, k+1] and values [n, k+1] (column 0 = the target, then the top k), and the
    target's 1-based rank [n] in the full distribution."""
    target_lp = logprobs.gather(1, target_ids.unsqueeze(1))  # [n, 1]
    ranks = (logprobs > target_lp).sum(dim=1) + 1  # [n]
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=1)  # [n, k]
        ids = torch.cat([target_ids.unsqueeze(1), top_ids], dim=1)
        values = torch.cat([target_lp, top_values], dim=1)
    else:
        ids, values = target_ids.unsqueeze(1), target_lp
    return ids, values, ranks


def to_token_logprobs(ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor) -> list[TokenLogprobs]:
    """One dict per row: the target with its rank, and the top-k with ranks 1..k."""
    out: list[TokenLogprobs] = []
    for row_ids, row_values, rank in zip(ids.tolist(), values.tolist(), ranks.tolist()):
        entry: TokenLogprobs = {row_ids[0]: Logprob(row_values[0], rank)}
        for j, (tok, value) in enumerate(zip(row_ids[1:], row_values[1:]), start=1):
            entry.setdefault(tok, Logprob(value, j))
        out.append(entry)
    return out
