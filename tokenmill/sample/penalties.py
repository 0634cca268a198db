"""Repetition (HF/vLLM semantics), presence and frequency (OpenAI semantics) penalties."""

from __future__ import annotations

import torch


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """tokens: [num_reqs, len] padded with vocab_size -> counts [num_reqs, vocab_size]."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.int64, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,  # [num_reqs, vocab_size] float32, changed in place
    prompt_tokens: torch.Tensor,  # [num_reqs, max_prompt_len]
    output_tokens: torch.Tensor,  # [num_reqs, max_output_len]
    repetition: torch.Tensor,  # [num_reqs]
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    vocab_size = logits.shape[1]
    out_counts = token_counts(output_tokens, vocab_size)
    seen = (token_counts(prompt_tokens, vocab_size) > 0) | (out_counts > 0)
    # Repetition: shrink the logit of every seen token towards "less likely", whatever its sign.
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits -= frequency.unsqueeze(1) * out_counts
    logits -= presence.unsqueeze(1) * (out_counts > 0)
    return logits
