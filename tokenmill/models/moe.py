"""One decoder for the mixture-of-experts families: Qwen2-MoE (QKV bias, a gated shared expert, dense
layers by decoder_sparse_step / mlp_only_layers), Qwen3-MoE (q/k RMSNorm), Mixtral and GraniteMoe
(embedding, attention, residual and logit multipliers).

The attention, norms, rotary and embedding are Llama's (models/llama.py); the MLP of a sparse layer is
models/layers/moe.py's SparseMoeBlock. The forward takes the same flat batch as Llama's."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits
from tokenmill.models.layers.moe import FusedExperts, SparseMoeBlock, TopKRouter
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding, rope_parameters
from tokenmill.models.llama import MLP, Attention, head_dim_of, load_tensor


@dataclass(frozen=True)
class MoeSpec:
    """What sets the families apart, read from the HF config."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int  # 0: no shared expert
    scoring: str  # TopKRouter's: "softmax_topk" or "topk_softmax"
    renormalize: bool
    round_weights: bool
    qk_norm: bool
    qkv_bias: bool
    sparse_layers: frozenset[int]  # the others have a dense MLP
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the attention scale; None: head_dim ** -0.5
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @staticmethod
    def of(hf_config: Any) -> MoeSpec:
        model_type = getattr(hf_config, "model_type", "")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"tokenmill's experts are SiLU-gated; this config asks for {hf_config.hidden_act!r}")
        if model_type in ("qwen2_moe", "qwen3_moe"):
            return _qwen_moe_spec(hf_config, model_type)
        if model_type in ("mixtral", "granitemoe"):
            return _mixtral_or_granite_spec(hf_config, granite=model_type == "granitemoe")
        raise ValueError(f"MoeForCausalLM does not serve model_type {model_type!r}")


def _qwen_moe_spec(hf_config: Any, model_type: str) -> MoeSpec:
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    num_experts = int(hf_config.num_experts)
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0
    return MoeSpec(
        num_experts=num_experts,
        top_k=int(hf_config.num_experts_per_tok),
        expert_intermediate_size=int(hf_config.moe_intermediate_size),
        shared_intermediate_size=shared,
        scoring="softmax_topk",
        renormalize=bool(hf_config.norm_topk_prob),
        round_weights=True,
        qk_norm=model_type == "qwen3_moe",
        qkv_bias=bool(getattr(hf_config, "qkv_bias", False) or getattr(hf_config, "attention_bias", False)),
        sparse_layers=frozenset(
            i for i in range(hf_config.num_hidden_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
        ),
    )


def _mixtral_or_granite_spec(hf_config: Any, granite: bool) -> MoeSpec:
    def multiplier(name: str) -> float:  # GraniteMoe's; 1 for Mixtral
        return float(getattr(hf_config, name, 1.0)) if granite else 1.0

    return MoeSpec(
        num_experts=int(hf_config.num_local_experts),
        top_k=int(hf_config.num_experts_per_tok),
        expert_intermediate_size=int(hf_config.intermediate_size),
        shared_intermediate_size=0,
        scoring="topk_softmax" if granite else "softmax_topk",
        renormalize=True,
        round_weights=granite,
        qk_norm=False,
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        sparse_layers=frozenset(range(hf_config.num_hidden_layers)),
        embedding_multiplier=multiplier("embedding_multiplier"),
        attention_multiplier=multiplier("attention_multiplier") if granite else None,
        residual_multiplier=multiplier("residual_multiplier"),
        logits_scaling=multiplier("logits_scaling"),
    )


def _check_full_attention(hf_config: Any, max_position: int) -> None:
    """Every layer here attends to the whole context: refuse a config whose sliding window would cut it."""
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    if window and window < max_position:
        raise ValueError(
            f"this {hf_config.model_type} config attends within a sliding window of {window} tokens, which "
            f"MoeForCausalLM does not implement; serve it with --max-model-len {window} or less."
        )


class MoeDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, spec: MoeSpec, index: int) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.self_attn = Attention(hf_config, spec.qk_norm, spec.qkv_bias, scale=spec.attention_multiplier)
        self.mlp: nn.Module
        if index in spec.sparse_layers:
            router = TopKRouter(
                hidden, spec.num_experts, spec.top_k, spec.scoring, spec.renormalize, spec.round_weights
            )
            self.mlp = SparseMoeBlock(
                hidden, spec.num_experts, spec.expert_intermediate_size, router, spec.shared_intermediate_size
            )
        else:
            self.mlp = MLP(hidden, hf_config.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.residual_multiplier = spec.residual_multiplier

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, meta, backend)
        if self.residual_multiplier != 1.0:  # GraniteMoe: residual + branch * m (the norm adds the residual)
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


# Checkpoint names of the experts (after "model." and Mixtral's / Granite's "block_sparse_moe." -> "mlp.")
_PER_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_SHARD = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# stacked: [E, 2 * I, H] gate rows then up rows, and [E, H, I] (GraniteMoe's names; transformers 5's own);
# gate and up apart, [E, I, H] each (GGUF's ffn_gate_exps / ffn_up_exps)
_STACKED = [
    (".mlp.input_linear.weight", ".mlp.experts", "gate_up"),
    (".mlp.output_linear.weight", ".mlp.experts", "down"),
    (".mlp.experts.gate_up_proj", ".mlp.experts", "gate_up"),
    (".mlp.experts.down_proj", ".mlp.experts", "down"),
    (".mlp.experts.gate_proj", ".mlp.experts", "gate"),
    (".mlp.experts.up_proj", ".mlp.experts", "up"),
]


class MoeForCausalLM(nn.Module):
    """Serves Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM and GraniteMoeForCausalLM."""

    def __init__(self, hf_config: Any, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.spec = MoeSpec.of(hf_config)
        _check_full_attention(hf_config, max_position)
        self.config = hf_config
        self.backend = backend
        self.vocab_size = int(hf_config.vocab_size)
        self.embed_tokens = VocabParallelEmbedding(self.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            MoeDecoderLayer(hf_config, self.spec, i) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(hf_config.hidden_size, self.vocab_size)
        self.rotary = RotaryEmbedding(head_dim_of(hf_config), max_position, rope_parameters(hf_config))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final hidden states, [num_tokens, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            hidden = hidden * self.spec.embedding_multiplier
        rotary = self.rotary(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rotary, meta, self.backend)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32, the same on every rank."""
        if self.lm_head is not None:  # a module, so quantization can swap it (see tokenmill.quant)
            logits = self.lm_head(hidden)  # [n, vocab / N]
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        if self.spec.logits_scaling != 1.0:  # GraniteMoe; in the model's dtype, as HF divides
            logits = logits / self.spec.logits_scaling
        return gather_logits(logits.float(), self.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into our parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            name = name.replace(".mlp.router.layer.", ".mlp.gate.")  # GraniteMoe's router
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            expert = self._load_expert(name, tensor)
            if expert is not None:
                loaded.add(expert)
                continue
            loaded.add(load_tensor(self, params, name, tensor))
        return loaded

    def _load_expert(self, name: str, tensor: torch.Tensor) -> str | None:
        """Load an expert tensor (one expert's, or every expert's stacked); its parameter's name, or None
        when `name` is not an expert tensor."""
        where = _expert_tensor(name)
        if where is None:
            return None
        path, shard, expert_id = where
        experts = self.get_submodule(path)
        if not isinstance(experts, FusedExperts):
            raise ValueError(f"checkpoint tensor {name!r} names experts in a layer that has none")
        param = experts.w2 if shard == "down" else experts.w13
        experts.weight_loader(param, tensor, shard, expert_id)
        return f"{path}.{'w2' if shard == 'down' else 'w13'}"


def _expert_tensor(name: str) -> tuple[str, str, int | None] | None:
    """(the FusedExperts' path, shard id, expert id or None when stacked) of an expert tensor's name."""
    match = _PER_EXPERT.search(name)
    if match is not None:
        return match.group(1), _EXPERT_SHARD[match.group(3)], int(match.group(2))
    for suffix, our_suffix, shard in _STACKED:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + our_suffix, shard, None
    return None
