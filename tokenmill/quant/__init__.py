"""Quantized linear methods, registered by name, applied as a module swap after the weights are loaded.

    LLM(quantization="int8")            # or: tokenmill generate --quantization int8

`quantize_model` replaces every linear layer (fused qkv, o, gate/up, down) and the LM head with the
method's module, built from the loaded float weights; with tied embeddings the embedding lookup stays
in full precision and the head gets its own quantized copy. The weight loaders never see quantized
tensors, so checkpoints stay plain bf16/fp32."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.quant.bf16 import Bf16Linear
from tokenmill.quant.int8 import Int8Linear

# name -> factory(weight [out, in], bias [out] | None, row_parallel) -> a module computing x @ weight.T + bias.
# row_parallel: the weight holds this tensor-parallel rank's input columns only (scales that span a whole
# row must then be agreed across the ranks).
QuantLinearFactory = Callable[[torch.Tensor, "torch.Tensor | None", bool], nn.Module]
_METHODS: dict[str, QuantLinearFactory] = {}


def register_quant_method(name: str, factory: QuantLinearFactory) -> None:
    _METHODS[name] = factory


def quant_methods() -> list[str]:
    return sorted(_METHODS)


def check_quantization(name: str | None) -> None:
    """Raise ValueError (listing the options) unless `name` is None or a registered method."""
    if name is not None and name not in _METHODS:
        raise ValueError(f"unknown quantization {name!r}; use one of {quant_methods()} (or none).")


@torch.no_grad()
def quantize_model(model: nn.Module, name: str) -> nn.Module:
    """Swap the model's linear layers and LM head for quantized ones, in place; returns the model."""
    check_quantization(name)
    return swap_linears(model, _METHODS[name])


@torch.no_grad()
def pack_bf16_weights(model: nn.Module) -> nn.Module:
    """Store the linear layers and LM head as packed bf16 for the C++ kernel (CPUs without bf16
    arithmetic, see bf16.py). The caller checks `tokenmill.ops.packed_gemm.available()` first."""
    return swap_linears(model, Bf16Linear)


def swap_linears(model: nn.Module, factory: QuantLinearFactory) -> nn.Module:
    """Replace every nn.Linear, and the LM head, with `factory(weight, bias)`, in place."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for path, linear in targets:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        quantized = factory(linear.weight, linear.bias, bool(getattr(linear, "row_parallel", False)))
        _keep_layout_attributes(linear, quantized)
        setattr(parent, child, quantized)
    if getattr(model, "lm_head", False) is None:  # tied: the head is the embedding's own copy
        embedding = getattr(model, "embed_tokens", None)
        if not isinstance(embedding, nn.Embedding):
            raise ValueError(f"{type(model).__name__} ties its head to an embedding it does not name embed_tokens")
        model.lm_head = factory(embedding.weight, None, False)
    return model


def _keep_layout_attributes(source: nn.Module, target: nn.Module) -> None:
    """Copy the replaced layer's plain layout attributes (QKVLinear's q_size/kv_size, MergedLinear's
    offsets, ...) so model code that reads them works unchanged on the quantized module."""
    for key, value in vars(source).items():
        if not key.startswith("_") and key not in vars(target) and isinstance(value, (int, float, list, tuple)):
            setattr(target, key, value)


register_quant_method(
    "int8", lambda weight, bias, row_parallel: Int8Linear.from_weight(weight, bias, None, row_parallel)
)

__all__ = [
    "Bf16Linear",
    "Int8Linear",
    "check_quantization",
    "pack_bf16_weights",
    "quant_methods",
    "quantize_model",
    "register_quant_method",
    "swap_linears",
]
