"""Gemma 2 and Gemma 3 (text): Gemma2ForCausalLM and Gemma3ForCausalLM.

Beside Llama: (1 + w) RMSNorms in float32, a norm after attention and after the MLP as well as before
each, GeGLU (gelu, tanh approximation), embeddings scaled by sqrt(hidden_size) in the model's dtype,
scores scaled by query_pre_attn_scalar ** -0.5, local (sliding-window) and global layers by
config.layer_types, tanh soft-capping of the attention scores and of the final logits (Gemma 2), q/k
norms and separate rope bases for local and global layers (Gemma 3). Window layers form their own KV
layer group (tokenmill/kv_groups.py), which keeps only the blocks the window reaches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.distributed.communication import all_reduce_
from tokenmill.distributed.parallel_state import tp_world_size
from tokenmill.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits
from tokenmill.models.layers.linear import MergedLinear, RowParallelLinear
from tokenmill.models.layers.lora import LoRAHeads, LoRALinear
from tokenmill.models.layers.rotary import RotaryEmbedding, rope_parameters
from tokenmill.models.llama import Attention, head_dim_of, load_tensor

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types_of(hf_config: Any) -> list[str]:
    """Each layer's kind: the config's layer_types, else Gemma 2's alternation (local first) or Gemma 3's
    sliding_window_pattern (every n-th layer global)."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return list(types)
    pattern = 2 if hf_config.model_type == "gemma2" else int(getattr(hf_config, "sliding_window_pattern", 6))
    return [SLIDING if (i + 1) % pattern else FULL for i in range(hf_config.num_hidden_layers)]


def rope_parameters_of(hf_config: Any, layer_type: str) -> dict[str, Any]:
    """Gemma 3 keeps a rope setting per layer type (the local base is rope_local_base_freq); Gemma 2 one."""
    nested = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type not in nested:
        return rope_parameters(hf_config)
    params = dict(nested[layer_type])
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), all in float32, then rounded once (HF's Gemma2RMSNorm / Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed x, x): called as Attention's q/k norm, which takes the first."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return normed.to(x.dtype), x


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.tensor_parallel = tp_world_size() > 1
        self.gate_up_lora: LoRALinear | None = None  # LoRA adapters' updates (set by tokenmill.lora)
        self.down_lora: LoRALinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate / N]
        if self.gate_up_lora is not None:
            self.gate_up_lora.add_to(x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.gelu(gate, approximate="tanh") * up
        out = self.down_proj(h)  # [num_tokens, hidden], partial under TP
        if self.down_lora is not None:
            self.down_lora.add_to(h, out)
        return all_reduce_(out) if self.tensor_parallel else out


class GemmaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_type: str) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        qk_norm = hf_config.model_type != "gemma2"
        self.self_attn = Attention(
            hf_config,
            qk_norm=qk_norm,
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            sliding_window=int(hf_config.sliding_window) if layer_type == SLIDING else None,
            logit_softcap=getattr(hf_config, "attn_logit_softcapping", None),
        )
        if qk_norm:  # Gemma 3's are (1 + w) norms too
            self.self_attn.q_norm = GemmaRMSNorm(self.self_attn.head_dim, eps)  # type: ignore[assignment]
            self.self_attn.k_norm = GemmaRMSNorm(self.self_attn.head_dim, eps)  # type: ignore[assignment]
        self.mlp = GemmaMLP(hidden, hf_config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rotary: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden)[0], rotary, meta, backend)
        hidden = hidden + self.post_attention_layernorm(attn)[0]
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden)[0])
        return hidden + self.post_feedforward_layernorm(mlp)[0]


class GemmaForCausalLM(nn.Module):
    """Serves Gemma2ForCausalLM and Gemma3ForCausalLM (model_type gemma2, gemma3_text)."""

    def __init__(self, hf_config: Any, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.config = hf_config
        self.backend = backend
        self.vocab_size = int(hf_config.vocab_size)
        self.hidden_size = int(hf_config.hidden_size)
        self.layer_types = layer_types_of(hf_config)
        self.embed_tokens = VocabParallelEmbedding(self.vocab_size, self.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(hf_config, t) for t in self.layer_types)
        self.norm = GemmaRMSNorm(self.hidden_size, hf_config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(self.hidden_size, self.vocab_size)
        self.final_logit_softcap: float | None = getattr(hf_config, "final_logit_softcapping", None)
        self.lora_heads: LoRAHeads | None = None  # LoRA adapters' LM head updates (set by tokenmill.lora)
        head_dim = head_dim_of(hf_config)
        # One rotary table per distinct rope setting (Gemma 3: local and global bases).
        self.rotary = nn.ModuleDict(
            {t: RotaryEmbedding(head_dim, max_position, rope_parameters_of(hf_config, t)) for t in (SLIDING, FULL)}
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final hidden states, [num_tokens, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        # The scale rounded to the model's dtype first, as HF does.
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        rotary = {t: rope(positions) for t, rope in self.rotary.items()}
        for layer, layer_type in zip(self.layers, self.layer_types):
            hidden = layer(hidden, rotary[layer_type], meta, self.backend)
        return self.norm(hidden)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32, soft-capped (Gemma 2), the same on every rank."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()  # [n, vocab / N]
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        logits = gather_logits(logits, self.vocab_size)
        if self.lora_heads is not None:  # before the cap, as in PEFT: the adapter is on lm_head
            self.lora_heads.add_to_logits(hidden, logits)
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into our parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            loaded.add(load_tensor(self, params, name, tensor))
        return loaded
