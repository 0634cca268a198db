"""Tiny random models of each family written as GGUF files the way llama.cpp's converter writes them
(its tensor names and metadata keys, q/k rows interleaved for Llama and Mistral, a GPT-2 style
tokenizer), with a mix of tensor types, and the HF reference that holds the same dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

from tests.tiny_models import make_tiny_tokenizer

Q = GGMLQuantizationType
# GGUF block tensor suffix -> HF block suffix, for every family (biases and q/k norms where present).
# Written out here, not imported from tokenmill/loader/gguf_arch.py: a wrong map there must fail the tests.
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Phi-3 keeps its fused tensors (gate and up in ffn_up); OLMo 2 has post-norms instead of pre-norms.
FAMILY_BLOCK_NAMES = {
    "phi3": {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
    "gemma2": {  # (1 + w) norms, stored as 1 + w
        **{k: v for k, v in BLOCK_NAMES.items() if k != "ffn_norm.weight"},
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "olmo2": {
        **{k: v for k, v in BLOCK_NAMES.items() if k not in ("attn_norm.weight", "ffn_norm.weight")},
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
# Mixture of experts (HF 5's in-memory names, Granite's block_sparse_moe read as mlp): the stacked
# gate_up_proj [E, 2I, H] is written as ffn_gate_exps and ffn_up_exps, as llama.cpp's converter does.
MOE_NAMES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.router.layer.weight": "ffn_gate_inp.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Every type gguf's Python can write, spread over the layers; gate and up (one fused layer in tokenmill)
# and q/k/v differ on purpose. 1-D tensors (norms, biases) stay F32 as llama.cpp keeps them.
MIXED_TYPES = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q8_0,
    "attn_qkv": Q.Q4_0,
    "attn_output": Q.F16,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_0,
    "output": Q.F32,
    "ffn_gate_exps": Q.Q4_0,  # gate and up share a format, as PackedExperts needs (and llama.cpp writes)
    "ffn_up_exps": Q.Q4_0,
    "ffn_down_exps": Q.Q8_0,
    "ffn_gate_shexp": Q.Q8_0,
    "ffn_up_shexp": Q.Q4_0,
    "ffn_down_shexp": Q.Q4_0,
}
# llama.cpp names Mistral checkpoints "llama"; the name tells them apart.
_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "qwen2-moe": "qwen2moe",
    "qwen3-moe": "qwen3moe",
    "mixtral": "llama",  # with experts
    "granitemoe": "granitemoe",
    "gemma2": "gemma2",
}


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to HF q/k rows: each head's two halves become interleaved pairs."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(hf_name: str, model_type: str) -> str:
    for gguf_name, name in GLOBAL_NAMES.items():
        if hf_name == name:
            return gguf_name
    layer, suffix = hf_name.removeprefix("model.layers.").split(".", 1)
    suffix = suffix.replace("block_sparse_moe.", "mlp.")
    if suffix in MOE_NAMES:
        return f"blk.{layer}.{MOE_NAMES[suffix]}"
    names = FAMILY_BLOCK_NAMES.get(model_type, BLOCK_NAMES)
    return f"blk.{layer}.{next(g for g, h in names.items() if h == suffix)}"


def gguf_pieces(hf_name: str, weight: torch.Tensor, model_type: str) -> list[tuple[str, torch.Tensor]]:
    """The GGUF tensors an HF parameter becomes: itself renamed, or stacked experts' gate and up apart
    (Gemma's norms: 1 + w, see gemma_offset)."""
    if hf_name.endswith(".experts.gate_up_proj"):
        layer = hf_name.removeprefix("model.layers.").split(".", 1)[0]
        gate, up = weight.chunk(2, dim=1)  # [E, I, H] each
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
    return [(_gguf_name(hf_name, model_type), weight + gemma_offset(hf_name, model_type))]


def gemma_offset(hf_name: str, model_type: str) -> float:
    """llama.cpp stores Gemma's norm weights w as 1 + w."""
    return 1.0 if model_type == "gemma2" and hf_name.endswith("norm.weight") else 0.0


def tensor_type(gguf_name: str, ndim: int, types: dict[str, GGMLQuantizationType]) -> GGMLQuantizationType:
    if ndim == 1:
        return Q.F32
    base = gguf_name.removesuffix(".weight").rsplit(".", 1)[-1] if "blk." in gguf_name else gguf_name[:-7]
    return types.get(base, Q.F32)


def round_trip(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """`weight` as gguf stores and dequantizes it."""
    values = dequantize(quantize(weight.float().numpy(), qtype), qtype)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(weight.shape)


def write_tiny_gguf(
    hf_folder: Path, out: Path, family: str, types: dict[str, GGMLQuantizationType] | None = None
) -> Path:
    """Write the HF tiny model in `hf_folder` (tests/tiny_models.py) as the GGUF file `out`."""
    from tests.tiny_models import hf_model

    types = MIXED_TYPES if types is None else types
    config = json.loads((hf_folder / "config.json").read_text())
    arch = _ARCH[family]
    writer = GGUFWriter(str(out), arch)
    writer.add_name(f"{family.capitalize()} tiny")
    _add_hparams(writer, config)
    _add_tokenizer(writer, config, pre="qwen2" if family.startswith("qwen") else "default")
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    # The loaded model's parameters: the names transformers 5 holds (a tied head appears once).
    for name, param in hf_model(hf_folder).named_parameters():
        weight = param.detach()
        projection = name.rsplit(".", 2)[-2]
        if arch == "llama" and projection in heads and name.endswith("weight"):
            weight = llama_cpp_permute(weight, heads[projection])
        for gguf_name, piece in gguf_pieces(name, weight, config["model_type"]):
            qtype = tensor_type(gguf_name, piece.dim(), types)
            writer.add_tensor(gguf_name, quantize(piece.float().contiguous().numpy(), qtype), raw_dtype=qtype)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":  # as llama.cpp writes Phi-3's factors: F32 tensors
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_hparams(writer: GGUFWriter, config: dict[str, Any]) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(partial * head_dim))  # Phi-3's converter: partial * hidden // heads
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if config["model_type"] == "granitemoe":
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    if config["model_type"] == "gemma2":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config["model_type"] == "phi3":
        original = config.get("original_max_position_embeddings") or config["max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(config.get("sliding_window") or 0)  # 0: none


def _add_tokenizer(writer: GGUFWriter, config: dict[str, Any], pre: str) -> None:
    """tests/tiny_models.py's byte-level BPE tokenizer, padded to the model's vocabulary as llama.cpp pads,
    with llama.cpp's name for the text split (`pre`: "qwen2" puts every digit on its own)."""
    tokenizer = make_tiny_tokenizer()
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = set(tokenizer.all_special_tokens)
    types = [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    padding = [f"[PAD{i}]" for i in range(len(tokens), config["vocab_size"])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens + padding)
    writer.add_token_types(types + [TokenType.UNUSED] * len(padding))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(int(config["bos_token_id"]))
    writer.add_eos_token_id(int(config["eos_token_id"]))
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")


def dequantized_hf_model(
    hf_folder: Path, types: dict[str, GGMLQuantizationType] | None = None, rounding: torch.dtype = torch.float32
) -> Any:
    """The HF model of `hf_folder` with every weight replaced by its GGUF round trip (same types as
    `write_tiny_gguf`), then rounded to `rounding` (bfloat16: what tokenmill's bf16 expansion holds):
    the reference a GGUF loader must reproduce."""
    from tests.tiny_models import hf_model

    types = MIXED_TYPES if types is None else types
    model = hf_model(hf_folder)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            pieces = gguf_pieces(name, param, model.config.model_type)
            offset = gemma_offset(name, model.config.model_type)  # what the loader subtracts again
            value = torch.cat(
                [round_trip(w, tensor_type(n, w.dim(), types)) for n, w in pieces], dim=1 if len(pieces) > 1 else 0
            )
            param.copy_((value - offset).to(rounding))
    return model
