"""Phi-3, Phi-3.5 and Phi-4 (incl. Phi-4-mini): Phi3ForCausalLM.

Llama's decoder (models/llama.py) with three differences: the checkpoint fuses q, k and v into one
`qkv_proj` and gate and up into one `gate_up_proj`, split here on load into the q/k/v and gate/up shards
our QKVLinear / MergedLinear load (so each tensor-parallel rank still takes only its heads and its
slice of the MLP); LongRoPE scaling; partial rotary (Phi-4-mini rotates 3/4 of each head). Both live in
models/layers/rotary.py. A config's sliding window (Phi-3-mini's 2047) applies to every layer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.models.llama import Attention, LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any, backend: AttentionBackend, max_position: int) -> None:
        super().__init__(hf_config, backend, max_position)
        window = getattr(hf_config, "sliding_window", None)
        if window is not None and window < max_position:  # a window as long as the context never cuts
            for layer in self.layers:
                cast(Attention, layer.self_attn).sliding_window = int(window)
        head_dim = head_dim_of(hf_config)
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        # rows of the fused checkpoint tensor: [q | k | v]
        self.qkv_sizes = [hf_config.num_attention_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names, fused or not) into our parameters; returns the names loaded."""
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """qkv_proj -> q_proj, k_proj, v_proj and gate_up_proj -> gate_proj, up_proj (views: a rank
        reads only its own slice of each below)."""
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                for piece, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split(self.qkv_sizes, dim=0)):
                    yield name.replace("qkv_proj", piece), part
            elif ".mlp.gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor
