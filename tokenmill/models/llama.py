"""One decoder for the Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm) families.

The forward takes a flat batch: every scheduled token of every request in one row
(`input_ids`, `positions`: [num_tokens]), with the attention metadata passed explicitly.
Under tensor parallelism each rank holds its heads and its slice of the MLP (models/layers/linear.py)
and sums the partial outputs of o_proj and down_proj over the ranks here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.distributed.communication import all_reduce_
from tokenmill.distributed.parallel_state import get_pp_stage, tp_world_size
from tokenmill.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits
from tokenmill.models.layers.linear import (
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    default_weight_loader,
)
from tokenmill.models.layers.lora import LoRAHeads, LoRALinear
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from tokenmill.ops.triton_ops import triton_ops

# checkpoint name piece -> (our fused parameter piece, shard id); the pieces of a fused layer in their row order
STACKED_PARAMS: list[tuple[str, str, str | int]] = [
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
]


def head_dim_of(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def load_tensor(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str:
    """Copy one checkpoint tensor (its name without "model.") into `model`'s parameter, through the owning
    module's weight loader, which takes only this rank's slice; a piece of a fused layer (q_proj, up_proj,
    ...) goes to its rows. Returns the parameter's name."""
    shard_id: str | int | None = None
    for ckpt_piece, our_piece, sid in STACKED_PARAMS:
        if f".{ckpt_piece}." in name:
            name, shard_id = name.replace(ckpt_piece, our_piece), sid
            break
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
    owner = model.get_submodule(name.rpartition(".")[0])
    loader = getattr(owner, "weight_loader", default_weight_loader)
    loader(param, tensor, shard_id)  # copies (and converts) only this rank's slice
    return name


class Attention(nn.Module):
    """scale: of the scores (default head_dim ** -0.5). sliding_window / logit_softcap: see
    AttentionBackend.forward; a window layer reads its KV layer group's block tables (kv_group, set by
    the model: 0 is the full-attention group, see tokenmill/kv_groups.py)."""

    def __init__(
        self,
        hf_config: Any,
        qk_norm: bool,
        qkv_bias: bool,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(hf_config)
        self.scale = scale if scale is not None else self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.kv_group = 0
        self.qkv_proj = QKVLinear(hf_config.hidden_size, self.head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hf_config.hidden_size)
        self.tensor_parallel = tp_world_size() > 1
        eps = hf_config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        # Bound by the model runner once the cache is allocated: [2, num_blocks, block_size, Hkv, D].
        self.kv_cache: torch.Tensor | None = None
        # LoRA adapters' updates to qkv_proj and o_proj (set by tokenmill.lora when adapters are served).
        self.qkv_lora: LoRALinear | None = None
        self.o_lora: LoRALinear | None = None

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rotary: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        # The LoRA adapters of qkv_proj and o_proj, when some rows of the step run one.
        qkv_lora, o_lora = self.qkv_lora, self.o_lora
        if qkv_lora is not None and o_lora is not None and qkv_lora.context.runs:
            qkv = qkv_lora.apply(self.qkv_proj, hidden)  # [num_tokens, (Hq + 2 * Hkv) * D]
        else:
            qkv, o_lora = self.qkv_proj(hidden), None
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self._norm_and_rotate(q, k, rotary)
        if self.kv_cache is None:
            raise RuntimeError("the KV cache was not bound to this attention layer")
        if self.kv_group:
            meta = meta.group_metadata[self.kv_group - 1]
        out = backend.forward(  # [num_tokens, Hq, D]
            q,
            k,
            v,
            self.kv_cache,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )
        out = out.reshape(n, self.num_heads * self.head_dim)
        out = (
            o_lora.apply(self.o_proj, out) if o_lora is not None else self.o_proj(out)
        )  # [num_tokens, hidden], partial
        return all_reduce_(out) if self.tensor_parallel else out

    def _norm_and_rotate(
        self,
        q: torch.Tensor,  # [num_tokens, Hq, D]
        k: torch.Tensor,  # [num_tokens, Hkv, D]
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k norms (Qwen3's per-head RMSNorms, or another model's own), then rotary."""
        q_norm, k_norm = self.q_norm, self.k_norm
        fused = triton_ops(q)
        if fused is not None and isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm):
            # CUDA, Qwen3: the per-head norms and rotary in one kernel, in place
            fused.qk_norm_rope_(q, k, rotary, q_norm.weight, k_norm.weight, q_norm.eps)
            return q, k
        if q_norm is not None and k_norm is not None:  # also Gemma's (1 + w) and OLMo 2's whole-projection norms
            q, k = q_norm(q)[0], k_norm(k)[0]
        if fused is None:
            return apply_rotary(rotary, q, k)
        fused.qk_norm_rope_(q, k, rotary, None, None, 0.0)
        return q, k


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.tensor_parallel = tp_world_size() > 1
        # LoRA adapters' updates to gate_up_proj and down_proj (set by tokenmill.lora).
        self.gate_up_lora: LoRALinear | None = None
        self.down_lora: LoRALinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up: [num_tokens, intermediate / N]; then [num_tokens, hidden], partial under TP
        if self.gate_up_lora is None or self.down_lora is None or not self.gate_up_lora.context.runs:
            out = self.down_proj(self.gate_up_proj.silu_and_mul(x))
            return all_reduce_(out) if self.tensor_parallel else out
        h = self.gate_up_lora.apply(self.gate_up_proj, x, silu_mul=True)  # the update lands before the activation
        out = self.down_lora.apply(self.down_proj, h)
        return all_reduce_(out) if self.tensor_parallel else out


class DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, qk_norm: bool, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = Attention(hf_config, qk_norm, qkv_bias)
        self.mlp = MLP(hf_config.hidden_size, hf_config.intermediate_size)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (see registry)."""

    def __init__(self, hf_config: Any, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        model_type = getattr(hf_config, "model_type", "llama")
        qk_norm = model_type == "qwen3"
        qkv_bias = bool(getattr(hf_config, "attention_bias", False)) or model_type == "qwen2"
        self.config = hf_config
        self.backend = backend
        self.vocab_size = int(hf_config.vocab_size)
        self.embed_tokens = VocabParallelEmbedding(self.vocab_size, hf_config.hidden_size)
        # A pipeline stage builds its own decoder layers only; `layers[i]` is the checkpoint's layer
        # first_layer + i. (Every stage keeps the embedding, final norm and head: the first stage looks
        # tokens up, the last computes logits, and a tied head is the embedding.)
        stage = get_pp_stage()
        self.first_layer, end = stage.layers or (0, int(hf_config.num_hidden_layers))
        self.layers = nn.ModuleList(DecoderLayer(hf_config, qk_norm, qkv_bias) for _ in range(end - self.first_layer))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(hf_config.hidden_size, self.vocab_size)
        self.rotary = RotaryEmbedding(head_dim_of(hf_config), max_position, rope_parameters(hf_config))
        self.lora_heads: LoRAHeads | None = None  # LoRA adapters' LM head updates (set by tokenmill.lora)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final hidden states, [num_tokens, hidden_size]."""
        return self.norm(*self.forward_stage(input_ids, positions, meta))[0]

    def forward_stage(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        received: tuple[torch.Tensor, torch.Tensor] | None = None,  # the previous stage's (hidden, residual)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This pipeline stage's layers: (hidden, residual) [num_tokens, hidden_size] each, before the
        final norm (the first stage looks the tokens up; the others continue from `received`)."""
        if received is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = received
        rotary = self.rotary(positions)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rotary, meta, self.backend)
        assert residual is not None  # every layer returns the residual stream
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32, the same on every rank."""
        if self.lm_head is not None:  # a module, so quantization can swap it (see tokenmill.quant)
            logits = self.lm_head(hidden).float()  # [n, vocab / N]
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        logits = gather_logits(logits, self.vocab_size)
        if self.lora_heads is not None:
            self.lora_heads.add_to_logits(hidden, logits)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into our parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if name.startswith("layers."):  # another pipeline stage's layer is not ours to load
                index, _, rest = name.removeprefix("layers.").partition(".")
                if not 0 <= int(index) - self.first_layer < len(self.layers):
                    continue
                name = f"layers.{int(index) - self.first_layer}.{rest}"
            loaded.add(load_tensor(self, params, name, tensor))
        return loaded
