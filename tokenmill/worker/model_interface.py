"""What the model runner and the loader need from a model (models/llama.py's LlamaForCausalLM is one).

The loader hands back an `nn.Module`, whose submodules mypy only knows as `Module | Tensor`; the
runner sees it through these protocols instead, so what it calls and the KV caches it binds are typed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from tokenmill.attention.metadata import AttentionMetadata


class PagedAttentionLayer(Protocol):
    """A layer's attention module: it reads and writes the KV cache the runner binds to it."""

    num_kv_heads: int
    head_dim: int
    kv_cache: torch.Tensor | None  # [2, num_blocks, block_size, num_kv_heads, head_dim (+4 in int8)]
    # Its KV layer group (tokenmill/kv_groups.py), set by the runner on sliding-window layers (attributes
    # `sliding_window`, read where present); 0, the full-attention group, elsewhere.
    kv_group: int


class DecoderLayer(Protocol):
    @property
    def self_attn(self) -> PagedAttentionLayer: ...


class LoadsWeights(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the names loaded."""
        ...


class CausalLM(Protocol):
    @property
    def layers(self) -> Sequence[DecoderLayer]: ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The final hidden states, [num_tokens, hidden_size]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32."""
        ...
