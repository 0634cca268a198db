"""The attention backend interface: what the model calls in every attention layer (implementations:
torch_ref.py, cpu.py, triton/; chosen by selector.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str
    # True when a decode step may be captured in a CUDA graph and replayed: the decode path reads only
    # device tensors, plus host values that the graph runner fixes at capture (see worker/cuda_graph.py).
    supports_cuda_graphs: bool

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, Hq, D]
        k: torch.Tensor,  # [num_tokens, Hkv, D]
        v: torch.Tensor,  # [num_tokens, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's k/v into the paged cache, then attend causally over each request's
        context (cached prefix + new tokens). Returns [num_tokens, Hq, D].

        sliding_window: query position p sees only keys j with p - sliding_window < j <= p (HF's rule).
        logit_softcap: scores become cap * tanh(score / cap) before the softmax."""
        ...
