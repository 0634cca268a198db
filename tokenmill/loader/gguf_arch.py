"""What each GGUF architecture means in Hugging Face terms: its config.json and its tensor names.

llama.cpp's converter writes Llama and Mistral checkpoints as architecture ``llama`` (Mistral's only
trace is ``general.name``) and interleaves their q/k rows for its rotary convention; ``qwen2`` (q/k/v
biases) and ``qwen3`` (q/k RMSNorm, an explicit head_dim) keep HF's row order. Every key is read under
the architecture's own prefix (``qwen2.rope.freq_base``, ...).
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
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool  # RMSNorm on each head's q and k (Qwen3)


_ARCHS = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", "llama", permuted_qk=True, qkv_bias=False, qk_norm=False),
    "mistral": GGUFArch("llama", "MistralForCausalLM", "mistral", permuted_qk=True, qkv_bias=False, qk_norm=False),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2", permuted_qk=False, qkv_bias=True, qk_norm=False),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3", permuted_qk=False, qkv_bias=False, qk_norm=True),
}

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
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
    if name == "llama" and "mistral" in str(field(reader, "general.name", "")).lower():
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
    scaling = field(reader, f"{p}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"RoPE scaling '{scaling}' is not supported by the GGUF loader")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden = int(field(reader, f"{p}.embedding_length"))
    heads = int(field(reader, f"{p}.attention.head_count"))
    head_dim = int(field(reader, f"{p}.attention.key_length", hidden // heads))
    rope_dim = int(field(reader, f"{p}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    rope_theta = _f32(field(reader, f"{p}.rope.freq_base", 10000.0))
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
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": optional_int(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": optional_int(reader, "tokenizer.ggml.padding_token_id"),
    }
    if arch.model_type in ("llama", "qwen3"):
        config |= {"attention_bias": False, "mlp_bias": False}
    if arch.model_type != "llama":  # llama.cpp runs every layer with full attention
        config |= {"sliding_window": None, "use_sliding_window": False}
    return config


def _eos_ids(reader: GGUFReader) -> list[int]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [i for i in (optional_int(reader, k) for k in keys) if i is not None]
    if not ids:
        raise ValueError("GGUF metadata has no tokenizer.ggml.eos_token_id; generation could never stop")
    return list(dict.fromkeys(ids))


def block_names(arch: GGUFArch) -> dict[str, str]:
    """GGUF block tensor suffix -> HF suffix, for the tensors `arch` has."""
    names = dict(_BLOCK_NAMES)
    if arch.qkv_bias:
        names |= _BIAS_NAMES
    if arch.qk_norm:
        names |= _QK_NORM_NAMES
    return names


def hf_name(gguf_name: str, arch: GGUFArch) -> str:
    """The HF checkpoint name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn...``)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    names = block_names(arch)
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
    suffixes = block_names(arch).values()
    for layer in range(config["num_hidden_layers"]):
        expected.update(f"model.layers.{layer}.{suffix}" for suffix in suffixes)
    return expected
