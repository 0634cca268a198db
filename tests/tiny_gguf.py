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
    "attn_output": Q.F16,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_0,
    "output": Q.F32,
}
# llama.cpp names Mistral checkpoints "llama"; the name tells them apart.
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to HF q/k rows: each head's two halves become interleaved pairs."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(hf_name: str) -> str:
    for gguf_name, name in GLOBAL_NAMES.items():
        if hf_name == name:
            return gguf_name
    layer, suffix = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{next(g for g, h in BLOCK_NAMES.items() if h == suffix)}"


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
    from safetensors.torch import load_file

    types = MIXED_TYPES if types is None else types
    config = json.loads((hf_folder / "config.json").read_text())
    arch = _ARCH[family]
    writer = GGUFWriter(str(out), arch)
    writer.add_name(f"{family.capitalize()} tiny")
    _add_hparams(writer, config)
    _add_tokenizer(writer, config, pre="qwen2" if family.startswith("qwen") else "default")
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, weight in load_file(str(hf_folder / "model.safetensors")).items():
        gguf_name = _gguf_name(name)
        projection = name.rsplit(".", 2)[-2]
        if arch == "llama" and projection in heads and name.endswith("weight"):
            weight = llama_cpp_permute(weight, heads[projection])
        qtype = tensor_type(gguf_name, weight.dim(), types)
        data = quantize(weight.float().numpy(), qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
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
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


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
            value = round_trip(param, tensor_type(_gguf_name(name), param.dim(), types))
            param.copy_(value.to(rounding))
    return model
