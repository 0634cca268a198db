"""What each GGUF architecture means in Hugging Face terms: its config.json and its tensor names.

llama.cpp's converter writes Llama and Mistral checkpoints as architecture ``llama`` (Mistral's only
trace is ``general.name``) and interleaves their q/k rows for its rotary convention; ``qwen2`` (q/k/v
biases), ``qwen3`` (q/k RMSNorm, an explicit head_dim), ``phi3`` (fused ``attn_qkv``, gate and up
fused in ``ffn_up``, LongRoPE factors as the tensors ``rope_factors_{short,long}``, partial rotary as
``rope.dimension_count``) and ``olmo2`` (``post_attention_norm`` / ``post_ffw_norm`` instead of the
pre-norms, q/k norms over the whole projection) keep HF's row order. Every key is read under the
architecture's own prefix (``qwen2.rope.freq_base``, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFReader


@dataclass(frozen=True)
class GGUFArch:
    """One GGUF architecture: the HF class it becomes and what its tensors look like."""

    prefix: str  # the metadata key prefix, general.architecture
    hf_architecture: str  # config.json "architectures"
    model_type: str
    permuted_qk: bool  # llama.cpp interleaved the q/k rows (see gguf.unpermute_rope_rows)
    block_names: dict[str, str]  # GGUF block tensor suffix -> HF suffix
    optional: frozenset[str] = frozenset()  # block suffixes not every layer has (MoE's dense or sparse MLPs)
    norm_offset: float = 0.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w: subtract it on load


GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that are metadata to us: Phi-3's LongRoPE factors (read into the config's rope_parameters).
ROPE_FACTOR_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
_LLAMA_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BIAS_NAMES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_QK_NORM_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Phi-3's checkpoint names: llama.cpp keeps its fused tensors (gate rows then up rows in ffn_up).
_PHI3_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_OLMO2_NAMES = {
    **{k: v for k, v in _LLAMA_NAMES.items() if not k.endswith("_norm.weight")},
    **_QK_NORM_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA2_NAMES = {
    **{k: v for k, v in _LLAMA_NAMES.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Experts stacked [E, rows, columns] (gate and up apart), the router, and Qwen2-MoE's gated shared expert.
_MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_MLP_NAMES = frozenset({"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", *_MOE_NAMES, *_SHARED_EXPERT_NAMES})
# fused HF tensor suffix -> its pieces' suffixes, in row order (sizes: fused_parts)
FUSED_NAMES = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}

_ARCHS = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", "llama", True, _LLAMA_NAMES),
    "mistral": GGUFArch("llama", "MistralForCausalLM", "mistral", True, _LLAMA_NAMES),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2", False, _LLAMA_NAMES | _BIAS_NAMES),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3", False, _LLAMA_NAMES | _QK_NORM_NAMES),
    "phi3": GGUFArch("phi3", "Phi3ForCausalLM", "phi3", False, _PHI3_NAMES),
    "olmo2": GGUFArch("olmo2", "Olmo2ForCausalLM", "olmo2", False, _OLMO2_NAMES),
    "gemma2": GGUFArch("gemma2", "Gemma2ForCausalLM", "gemma2", False, _GEMMA2_NAMES, norm_offset=1.0),
    # llama.cpp writes Mixtral as "llama" with experts (read_arch tells them apart)
    "mixtral": GGUFArch("llama", "MixtralForCausalLM", "mixtral", True, _LLAMA_NAMES | _MOE_NAMES, _MLP_NAMES),
    "qwen2moe": GGUFArch(
        "qwen2moe",
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        False,
        _LLAMA_NAMES | _BIAS_NAMES | _MOE_NAMES | _SHARED_EXPERT_NAMES,
        _MLP_NAMES,
    ),
    "qwen3moe": GGUFArch(
        "qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", False, _LLAMA_NAMES | _QK_NORM_NAMES | _MOE_NAMES, _MLP_NAMES
    ),
    "granitemoe": GGUFArch(
        "granitemoe", "GraniteMoeForCausalLM", "granitemoe", False, _LLAMA_NAMES | _MOE_NAMES, _MLP_NAMES
    ),
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
_REQUIRED = object()  # sentinel: a metadata key without a default


def field(reader: GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """A metadata value; a missing key without a default is a ValueError naming it."""
    found = reader.get_field(key)
    if found is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata is missing required key {key!r}")
        return default
    return found.contents()


def optional_int(reader: GGUFReader, key: str) -> int | None:
    found = reader.get_field(key)
    return None if found is None else int(found.contents())


def read_arch(reader: GGUFReader) -> GGUFArch:
    """The file's architecture; Mistral is ``llama`` with a Mistral name (as transformers reads it too)."""
    name = str(field(reader, "general.architecture"))
    if name == "llama" and (optional_int(reader, "llama.expert_count") or 0) > 0:
        name = "mixtral"
    elif name == "llama" and "mistral" in str(field(reader, "general.name", "")).lower():
        name = "mistral"
    if name not in _ARCHS:
        raise ValueError(f"GGUF architecture {name!r} is not supported; tokenmill reads {sorted(set(_ARCHS))}")
    return _ARCHS[name]


def _f32(value: float) -> float:
    # GGUF stores float32; its shortest repr recovers the decimal the model was trained with (1e-05).
    return float(str(np.float32(value)))


def read_config(reader: GGUFReader, arch: GGUFArch) -> dict[str, Any]:
    """config.json contents for `arch` from the file's metadata and tensor shapes."""
    p = arch.prefix
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden = int(field(reader, f"{p}.embedding_length"))
    heads = int(field(reader, f"{p}.attention.head_count"))
    head_dim = int(field(reader, f"{p}.attention.key_length", hidden // heads))
    rope_dim = int(field(reader, f"{p}.rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch.model_type != "phi3":
        raise ValueError(f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    rope = _rope_parameters(reader, p, tensors)
    rope_theta = rope["rope_theta"]
    eos_ids = _eos_ids(reader)
    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # ne order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, f"{p}.feed_forward_length")),
        "num_hidden_layers": int(field(reader, f"{p}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{p}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(field(reader, f"{p}.context_length")),
        "rms_norm_eps": _f32(field(reader, f"{p}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,  # read by transformers < 5
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": optional_int(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": optional_int(reader, "tokenizer.ggml.padding_token_id"),
    }
    if arch.model_type in ("llama", "qwen3", "olmo2", "qwen3_moe", "mixtral", "granitemoe"):
        config |= {"attention_bias": False, "mlp_bias": False}
    if arch.optional:  # mixture of experts
        config |= _moe_config(reader, arch, tensors, config)
    if rope_dim != head_dim:
        rope["partial_rotary_factor"] = config["partial_rotary_factor"] = rope_dim / head_dim
    if "original_max_position_embeddings" in rope:
        config["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if arch.model_type == "gemma2":
        config |= _gemma2_config(reader, p, config)
    elif arch.model_type == "phi3":  # 0: none (Phi-4)
        config["sliding_window"] = int(field(reader, f"{p}.attention.sliding_window", 0)) or None
    elif arch.model_type != "llama":  # llama.cpp runs every layer with full attention
        config |= {"sliding_window": None, "use_sliding_window": False}
    return config


def _gemma2_config(reader: GGUFReader, p: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's window, soft-caps and score scale. The file has no query_pre_attn_scalar: llama.cpp
    scales by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for the 27B model (46 layers)."""
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == 46:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "sliding_window": int(field(reader, f"{p}.attention.sliding_window")),
        "attn_logit_softcapping": _f32(field(reader, f"{p}.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": _f32(field(reader, f"{p}.final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
    }


def stored_offset(name: str, arch: GGUFArch) -> float:
    """What llama.cpp added to the HF tensor `name` (Gemma's norm weights: 1)."""
    return arch.norm_offset if name.endswith("norm.weight") else 0.0


def _moe_config(reader: GGUFReader, arch: GGUFArch, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The experts' config keys: count, top-k, their width; Qwen2-MoE's shared expert and dense layers
    (those without ffn_gate_exps); GraniteMoe's multipliers. llama.cpp renormalizes the top-k weights
    of Qwen3-MoE, Mixtral and GraniteMoe and not Qwen2-MoE's, as their HF configs do."""
    p = arch.prefix
    num_experts, top_k = int(field(reader, f"{p}.expert_count")), int(field(reader, f"{p}.expert_used_count"))
    expert_width = int(field(reader, f"{p}.expert_feed_forward_length", config["intermediate_size"]))
    if arch.model_type in ("mixtral", "granitemoe"):
        out: dict[str, Any] = {"num_local_experts": num_experts, "num_experts_per_tok": top_k}
        out["intermediate_size"] = expert_width
        if arch.model_type == "granitemoe":
            out |= {
                "attention_multiplier": _f32(field(reader, f"{p}.attention.scale", 1.0)),
                "embedding_multiplier": _f32(field(reader, f"{p}.embedding_scale", 1.0)),
                "residual_multiplier": _f32(field(reader, f"{p}.residual_scale", 1.0)),
                "logits_scaling": _f32(field(reader, f"{p}.logit_scale", 1.0)),
            }
        return out
    dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_exps.weight" not in tensors]
    out = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_width,
        "norm_topk_prob": arch.model_type == "qwen3_moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }
    if arch.model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(field(reader, f"{p}.expert_shared_feed_forward_length", 0))
        out["qkv_bias"] = True
    return out


def _rope_parameters(reader: GGUFReader, p: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """HF rope_parameters: the base, and linear / YaRN scaling by the rope.scaling keys, or LongRoPE
    (Phi-3) by its factor tensors."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(field(reader, f"{p}.rope.freq_base", 10000.0))}
    original = optional_int(reader, f"{p}.rope.scaling.original_context_length")
    if all(name in tensors for name in ROPE_FACTOR_TENSORS):
        rope["rope_type"] = "longrope"
        for name, key in ROPE_FACTOR_TENSORS.items():
            rope[key] = [_f32(v) for v in np.asarray(tensors[name].data, dtype=np.float32).tolist()]
        rope["original_max_position_embeddings"] = original or int(field(reader, f"{p}.context_length"))
        return rope
    scaling = field(reader, f"{p}.rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        rope |= {"rope_type": scaling, "factor": _f32(field(reader, f"{p}.rope.scaling.factor"))}
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = original or int(field(reader, f"{p}.context_length"))
    elif scaling != "none":
        raise ValueError(f"RoPE scaling '{scaling}' is not supported by the GGUF loader")
    return rope


def _eos_ids(reader: GGUFReader) -> list[int]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [i for i in (optional_int(reader, k) for k in keys) if i is not None]
    if not ids:
        raise ValueError("GGUF metadata has no tokenizer.ggml.eos_token_id; generation could never stop")
    return list(dict.fromkeys(ids))


def is_weight(gguf_name: str) -> bool:
    """Whether the tensor is a model weight (not metadata stored as a tensor, ROPE_FACTOR_TENSORS)."""
    return gguf_name not in ROPE_FACTOR_TENSORS


def fused_parts(name: str, config: dict[str, Any]) -> list[tuple[str, int, int]]:
    """A fused HF tensor's pieces (name, first row, rows), in row order; [] when `name` is not fused."""
    fused = next((f for f in FUSED_NAMES if name.endswith(f".{f}")), None)
    if fused is None:
        return []
    prefix = name.removesuffix(fused)
    if fused.startswith("self_attn."):
        head_dim, kv = int(config["head_dim"]), int(config["num_key_value_heads"])
        sizes = [int(config["num_attention_heads"]) * head_dim, kv * head_dim, kv * head_dim]
    else:
        sizes = [int(config["intermediate_size"])] * 2
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(prefix + piece, start, size) for piece, start, size in zip(FUSED_NAMES[fused], starts, sizes)]


def hf_name(gguf_name: str, arch: GGUFArch) -> str:
    """The HF checkpoint name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn...``)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    names = arch.block_names
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"unsupported tensor {gguf_name!r} in a {arch.prefix} GGUF file")
    return f"model.layers.{match.group(1)}.{names[match.group(2)]}"


def rope_heads(name: str, arch: GGUFArch, config: dict[str, Any]) -> int | None:
    """The head count to unpermute `name`'s rows by (llama.cpp's q/k interleaving), None if it is not permuted."""
    if not arch.permuted_qk:
        return None
    if name.endswith("q_proj.weight"):
        return int(config["num_attention_heads"])
    if name.endswith("k_proj.weight"):
        return int(config["num_key_value_heads"])
    return None


def expected_names(arch: GGUFArch, config: dict[str, Any]) -> set[str]:
    """Every HF tensor name a complete file of this architecture and config provides."""
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    suffixes = [hf for gguf_name, hf in arch.block_names.items() if gguf_name not in arch.optional]
    for layer in range(config["num_hidden_layers"]):
        expected.update(f"model.layers.{layer}.{suffix}" for suffix in suffixes)
    return expected
