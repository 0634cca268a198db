"""Request-specific changes to the logits before sampling: logit_bias, repetition penalty (HF/vLLM
semantics), presence and frequency penalties (OpenAI semantics), and min_tokens masking.

All of them change `logits` ([num_reqs, vocab_size] float32) in place.
"""

from __future__ import annotations

import torch


def apply_logit_bias(
    logits: torch.Tensor,  # [num_reqs, vocab_size]
    rows: torch.Tensor,  # [num_biases] int64
    token_ids: torch.Tensor,  # [num_biases] int64
    values: torch.Tensor,  # [num_biases] float32
) -> None:
    """Adds `values[i]` to `logits[rows[i], token_ids[i]]`."""
    logits.index_put_((rows, token_ids), values, accumulate=True)


def mask_tokens(
    logits: torch.Tensor,  # [num_reqs, vocab_size]
    rows: torch.Tensor,  # [num_masked] int64
    token_ids: torch.Tensor,  # [num_masked] int64
) -> None:
    """Sets `logits[rows[i], token_ids[i]]` to -inf, so that token can never be picked."""
    logits.index_put_((rows, token_ids), logits.new_full((), float("-inf")))  # a fill, not a host copy


def apply_penalties(
    logits: torch.Tensor,  # [num_reqs, vocab_size]
    prompt_token_ids: torch.Tensor,  # [num_reqs, max_prompt_len] int64, padded with vocab_size
    output_token_ids: torch.Tensor,  # [num_reqs, max_output_len] int64, padded with vocab_size
    repetition_penalty: torch.Tensor,  # [num_reqs]
    presence_penalty: torch.Tensor,  # [num_reqs]
    frequency_penalty: torch.Tensor,  # [num_reqs]
) -> None:
    """Repetition penalty on every token seen in the prompt or the output: a positive logit is divided
    by it, a negative one multiplied, so a penalty > 1 always makes the token less likely. Then, over
    output tokens only, `logit -= frequency * count + presence * (count > 0)`."""
    num_reqs, vocab_size = logits.shape
    output_counts = token_counts(output_token_ids, num_reqs, vocab_size)  # [num_reqs, vocab_size]
    in_output = output_counts > 0  # [num_reqs, vocab_size]
    seen = in_output | token_counts(prompt_token_ids, num_reqs, vocab_size).bool()

    rep = repetition_penalty.unsqueeze(1)  # [num_reqs, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)  # [num_reqs, vocab_size]
    torch.where(seen, penalized, logits, out=logits)
    logits -= frequency_penalty.unsqueeze(1) * output_counts
    logits -= presence_penalty.unsqueeze(1) * in_output


def token_counts(token_ids: torch.Tensor, num_reqs: int, vocab_size: int) -> torch.Tensor:
    """[num_reqs, len] ids padded with vocab_size -> [num_reqs, vocab_size] int32 occurrence counts."""
    counts = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]  # the last column only collected the padding
