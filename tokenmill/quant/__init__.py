"""Quantized linear methods, registered by name, applied as a module swap after the weights are loaded.

    LLM(quantization="int8")            # or: tokenmill generate --quantization int8
    LLM(quantization="int4", quantization_group_size=128, quantization_zero_point=True)

`quantize_model` replaces every linear layer (fused qkv, o, gate/up, down) and the LM head with the
method's module, built from the loaded float weights; with tied embeddings the embedding lookup stays
in full precision and the head gets its own quantized copy. The weight loaders never see quantized
tensors, so checkpoints stay plain bf16/fp32.

    LLM("model.Q4_K_M.gguf", quantization="gguf")   # the file's own blocks, repacked (quant/gguf.py)

"gguf" is no swap: a .gguf file's quantized layers are built from its blocks before the float weights
load (tokenmill/worker/gguf_native.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.quant.bf16 import Bf16Linear, Fp32Linear, PackedFloatLinear
from tokenmill.quant.experts import PackedExperts
from tokenmill.quant.grouped import GroupedLinear, GroupedWeight, dequantize_grouped
from tokenmill.quant.int4 import DEFAULT_GROUP_SIZE, Int4Linear, check_group_size
from tokenmill.quant.int8 import Int8Linear

# factory(weight [out, in], bias [out] | None, row_parallel) -> a module computing x @ weight.T + bias.
# row_parallel: the weight holds this tensor-parallel rank's input columns only (scales that span a whole
# row must then be agreed across the ranks).
QuantLinearFactory = Callable[[torch.Tensor, "torch.Tensor | None", bool], nn.Module]


@dataclass(frozen=True)
class QuantOptions:
    """A method's settings (--quantization-group-size, --quantization-zero-point); int4 takes them."""

    group_size: int | None = None  # in-features per scale; None: the method's default
    zero_point: bool = False  # a minimum per group as well as a scale


# name -> method(options) -> the factory; a method raises ValueError for options it does not take
QuantMethod = Callable[[QuantOptions], QuantLinearFactory]
_METHODS: dict[str, QuantMethod] = {}


def register_quant_method(name: str, method: QuantMethod) -> None:
    _METHODS[name] = method


def quant_methods() -> list[str]:
    return sorted(_METHODS)


def check_quantization(name: str | None, options: QuantOptions = QuantOptions()) -> None:
    """Raise ValueError (saying what to use) unless `name` is None or a registered method that takes
    `options`."""
    _factory(name, options)


def _factory(name: str | None, options: QuantOptions) -> QuantLinearFactory | None:
    if name is None:
        if options != QuantOptions():
            raise ValueError("--quantization-group-size and --quantization-zero-point need --quantization int4.")
        return None
    if name not in _METHODS:
        raise ValueError(f"unknown quantization {name!r}; use one of {quant_methods()} (or none).")
    return _METHODS[name](options)


@torch.no_grad()
def quantize_model(model: nn.Module, name: str, options: QuantOptions = QuantOptions()) -> nn.Module:
    """Swap the model's linear layers and LM head for quantized ones, in place; returns the model."""
    factory = _factory(name, options)
    if factory is None:
        raise ValueError("quantize_model needs a quantization method, not None.")
    return swap_linears(model, factory)


@torch.no_grad()
def pack_bf16_weights(model: nn.Module) -> nn.Module:
    """Store the linear layers and LM head as packed bf16 for the C++ kernel (CPUs without bf16
    arithmetic, see bf16.py). The caller checks `tokenmill.ops.packed_gemm.available()` first."""
    return swap_linears(model, Bf16Linear)


@torch.no_grad()
def pack_fp32_weights(model: nn.Module) -> nn.Module:
    """Store the linear layers and LM head as float32 panels for the C++ kernel (AVX2 builds: see
    Fp32Linear). The caller checks `tokenmill.ops.packed_gemm.isa() == "avx2"` first."""
    return swap_linears(model, Fp32Linear)


def swap_linears(model: nn.Module, factory: QuantLinearFactory) -> nn.Module:
    """Replace every nn.Linear, and the LM head, with `factory(weight, bias)`, in place."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for path, linear in targets:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        quantized = factory(linear.weight, linear.bias, bool(getattr(linear, "row_parallel", False)))
        keep_layout_attributes(linear, quantized)
        setattr(parent, child, quantized)
    if getattr(model, "lm_head", False) is None:  # tied: the head is the embedding's own copy
        embedding = getattr(model, "embed_tokens", None)
        if not isinstance(embedding, nn.Embedding):
            raise ValueError(f"{type(model).__name__} ties its head to an embedding it does not name embed_tokens")
        model.lm_head = factory(embedding.weight, None, False)
    return model


def keep_layout_attributes(source: nn.Module, target: nn.Module) -> None:
    """Copy the replaced layer's plain layout attributes (QKVLinear's q_size/kv_size, MergedLinear's
    offsets, ...) so model code that reads them works unchanged on the quantized module."""
    for key, value in vars(source).items():
        if not key.startswith("_") and key not in vars(target) and isinstance(value, (int, float, list, tuple)):
            setattr(target, key, value)


def _int8(options: QuantOptions) -> QuantLinearFactory:
    if options != QuantOptions():
        raise ValueError(
            "int8 has one scale per output channel: --quantization-group-size and --quantization-zero-point "
            "are int4's settings."
        )
    return lambda weight, bias, row_parallel: Int8Linear.from_weight(weight, bias, None, row_parallel)


def _int4(options: QuantOptions) -> QuantLinearFactory:
    group_size = DEFAULT_GROUP_SIZE if options.group_size is None else options.group_size
    check_group_size(group_size)
    # A group's scale spans `group_size` input columns of one row: under tensor parallelism a rank's
    # columns hold whole groups when its slice is a multiple of the group size, so nothing is agreed.
    return lambda weight, bias, row_parallel: Int4Linear.from_weight(
        weight, bias, group_size=group_size, zero_point=options.zero_point
    )


def _gguf(options: QuantOptions) -> QuantLinearFactory:
    if options != QuantOptions():
        raise ValueError(
            "gguf serves a .gguf file's own blocks: --quantization-group-size and --quantization-zero-point "
            "are int4's settings."
        )

    def refuse(weight: torch.Tensor, bias: torch.Tensor | None, row_parallel: bool) -> nn.Module:
        raise ValueError(
            "quantization 'gguf' serves the quantized blocks of a .gguf file as they are "
            "(tokenmill/worker/gguf_native.py); it does not quantize float weights."
        )

    return refuse


register_quant_method("int8", _int8)
register_quant_method("int4", _int4)
register_quant_method("gguf", _gguf)

__all__ = [
    "Bf16Linear",
    "Fp32Linear",
    "PackedFloatLinear",
    "GroupedLinear",
    "GroupedWeight",
    "Int4Linear",
    "Int8Linear",
    "PackedExperts",
    "QuantOptions",
    "check_quantization",
    "dequantize_grouped",
    "keep_layout_attributes",
    "pack_bf16_weights",
    "pack_fp32_weights",
    "quant_methods",
    "quantize_model",
    "register_quant_method",
    "swap_linears",
]
