"""OLMo 2: Olmo2ForCausalLM.

Beside Llama (models/llama.py): no norm before attention or the MLP; a norm on each one's output
instead (post_attention_layernorm, post_feedforward_layernorm), added to the residual after; and q/k
RMSNorms over the whole q and k projections (all heads at once), before rotary. Under tensor
parallelism a rank holds only its heads, so those norms sum the squares over the ranks (one small
all-reduce each) to stay exact."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.distributed.communication import all_reduce_
from tokenmill.distributed.parallel_state import tp_world_size
from tokenmill.models.layers.linear import QKVLinear, default_weight_loader
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.llama import MLP, Attention, LlamaForCausalLM


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over all heads of a projection, [num_tokens, H, D] as H * D values, of which this rank
    holds its heads: weight [H_rank * D], the statistic summed over the ranks. `replicas`: how many
    ranks hold each head (KV heads, when there are more ranks than KV heads), so each is counted once."""

    def __init__(self, qkv: QKVLinear, shard: str, total_heads: int, eps: float) -> None:
        super().__init__()
        local_heads = qkv.num_heads if shard == "q" else qkv.num_kv_heads
        self.eps, self.total = eps, total_heads * qkv.head_dim
        self.start = qkv.tp_rank * qkv.q_size if shard == "q" else qkv.kv_head_start * qkv.head_dim
        self.replicas = tp_world_size() * local_heads // total_heads
        self.tensor_parallel = tp_world_size() > 1
        self.weight = nn.Parameter(torch.ones(local_heads * qkv.head_dim))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        default_weight_loader(param, loaded.narrow(0, self.start, param.shape[0]), shard_id)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed x, x), as the Attention's q/k norm is called; statistics and weight in float32 (HF)."""
        flat = x.reshape(x.shape[0], -1).float()  # [num_tokens, H_rank * D]
        sum_sq = flat.pow(2).sum(-1, keepdim=True)  # [num_tokens, 1]
        if self.tensor_parallel:
            sum_sq = all_reduce_(sum_sq) / self.replicas
        normed = self.weight.float() * (flat * torch.rsqrt(sum_sq / self.total + self.eps))
        return normed.to(x.dtype).view_as(x), x


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = Attention(hf_config, qk_norm=False, qkv_bias=bool(getattr(hf_config, "attention_bias", False)))
        qkv = self.self_attn.qkv_proj
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        # Set as the Attention's q/k norms, which it applies between the projection and rotary.
        self.self_attn.q_norm = ProjectionRMSNorm(qkv, "q", hf_config.num_attention_heads, eps)  # type: ignore[assignment]
        self.self_attn.k_norm = ProjectionRMSNorm(qkv, "k", num_kv_heads, eps)  # type: ignore[assignment]
        self.mlp = MLP(hidden, hf_config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rotary: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, rotary, meta, backend))[0]
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))[0]


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Llama's embedding, final norm, head, rotary and loading; OLMo 2's layers."""

    def __init__(self, hf_config: Any, backend: AttentionBackend, max_position: int) -> None:
        super().__init__(hf_config, backend, max_position)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(hf_config) for _ in range(hf_config.num_hidden_layers))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final hidden states, [num_tokens, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        rotary = self.rotary(positions)
        for layer in self.layers:
            hidden = layer(hidden, rotary, meta, self.backend)
        return self.norm(hidden)[0]
