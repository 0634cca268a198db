"""Group-wise 4-bit weights, quantized at load time from a float checkpoint by round-to-nearest.

    LLM(quantization="int4")                                   # groups of 32, symmetric
    LLM(quantization="int4", quantization_group_size=128, quantization_zero_point=True)

Each group of `group_size` consecutive in-features of an output channel has its own float16 scale d
(and, with a zero point, a float16 minimum m); a weight is one of 16 levels:
- symmetric (llama.cpp's Q4_0 format): w = d * (q - 8);
- with a zero point (Q4_1's): w = d * q + m.
d and m are fit per group (int4_fit.py: a few grids tried, least squares on each), rounded to float16,
and then every weight is rounded to its nearest level against the rounded values, so the stored
weights are exactly what `dequantize` returns. K not a multiple of the group size is padded with zero
weights (the kernel's activations are zero there too), which the fit leaves out.

The C++ GEMM (ops/csrc/packed_int4.h, and packed_gemm_avx512.h with AVX-512 VNNI) reads two levels
per byte and quantizes the activation rows to int8 groups of 32 as the int8 path's AVX-512 kernel
does, on every instruction set: one integer dot product per (group, channel), then
d * dot + m * sum(x) in float32. Decode moves ~4.5 bits per weight (5 with minimums) at groups of 32."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.ops import packed_gemm
from tokenmill.quant.bf16 import split_silu_mul
from tokenmill.quant.int4_fit import fit_symmetric, fit_with_minimums
from tokenmill.quant.panels import PANEL, pack_int4, unpack_int4

GROUP_SIZES = (32, 128)
DEFAULT_GROUP_SIZE = 32


class Int4Weight(NamedTuple):
    """A quantized [out, in] weight: levels q [out, in padded] uint8 in 0..15, scales d [out, G] and,
    with a zero point, minimums m [out, G], float16; G = in padded / group_size."""

    levels: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor | None

    @property
    def group_size(self) -> int:
        return self.levels.shape[1] // self.scales.shape[1]


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size {group_size} is not supported; use one of {GROUP_SIZES}.")


def quantize_groups(weight: torch.Tensor, group_size: int, zero_point: bool) -> Int4Weight:
    """[out, in] float -> Int4Weight: each group's scale (and minimum) fit (int4_fit.py), rounded to
    float16, then every weight rounded to its nearest level (see the module docstring)."""
    check_group_size(group_size)
    w = weight.detach().float()
    out_features, in_features = w.shape
    pad = (-in_features) % group_size
    groups = F.pad(w, (0, pad)).view(out_features, -1, group_size)  # [out, G, group_size]
    if zero_point:
        valid = (torch.arange(in_features + pad) < in_features).view(-1, group_size)  # [G, group_size]
        d, m = fit_with_minimums(groups, valid)
        d16, m16 = d.clamp_min(0).half(), m.half()
        q = torch.round((groups - m16.float()[..., None]) * _inverse(d16)[..., None]).clamp_(0, 15)
        return Int4Weight(q.to(torch.uint8).view(out_features, -1), d16, m16)
    d16 = fit_symmetric(groups).half()
    q = (torch.round(groups * _inverse(d16)[..., None]) + 8).clamp_(0, 15)
    return Int4Weight(q.to(torch.uint8).view(out_features, -1), d16, None)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in float32, 0 where the scale is 0 (an all-equal group: every weight at one level)."""
    d = scale.float()
    return torch.where(d != 0, 1 / d, torch.zeros_like(d))


def dequantize_groups(weight: Int4Weight, in_features: int) -> torch.Tensor:
    """Int4Weight -> float32 [out, in_features], the values the kernels multiply by."""
    out_features = weight.levels.shape[0]
    levels = weight.levels.float().view(out_features, -1, weight.group_size)
    d = weight.scales.float()[..., None]
    w = levels * d + weight.minimums.float()[..., None] if weight.minimums is not None else (levels - 8) * d
    return w.view(out_features, -1)[:, :in_features]


def default_kernel(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" and packed_gemm.available() else "reference"


class Int4Linear(nn.Module):
    """y = x @ dequantize(weight).T + bias with 4-bit group-wise weights; float inputs [num_tokens, in]
    and outputs [num_tokens, out] in the input's dtype.

    `kernel` is fixed at construction: "cpu" (the C++ GEMM) or "reference" (dequantize on each call,
    then F.linear; any device). Both store the same packed layout (panels.pack_int4)."""

    qweight: torch.Tensor
    params: torch.Tensor
    bias: torch.Tensor

    def __init__(self, weight: Int4Weight, in_features: int, bias: torch.Tensor | None, kernel: str) -> None:
        super().__init__()
        if kernel not in ("cpu", "reference"):
            raise ValueError(f"unknown int4 kernel {kernel!r}; use 'cpu' or 'reference'.")
        if kernel == "cpu" and not packed_gemm.available():  # (loads the kernel's ops)
            raise ValueError("the int4 'cpu' kernel could not be built here; use kernel='reference'.")
        self.out_features, self.in_features = weight.levels.shape[0], in_features
        self.group_size = weight.group_size
        self.zero_point = weight.minimums is not None
        self.kernel = kernel
        pad = (-self.out_features) % PANEL
        # [P, in padded, 8] uint8 (two levels a byte) and [P, G, 16] (or [P, G, 2, 16] with minimums) float16
        qweight, params = pack_int4(*weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("params", params)
        bias = torch.zeros(self.out_features) if bias is None else bias.detach().float()
        self.register_buffer("bias", F.pad(bias, (0, pad)))  # [P * 16]

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
        zero_point: bool = False,
        kernel: str | None = None,
    ) -> Int4Linear:
        """Quantize a float weight [out, in] (and keep its bias in float32)."""
        quantized = quantize_groups(weight, group_size, zero_point)
        return cls(quantized, weight.shape[1], bias, kernel or default_kernel(weight.device))

    def int4_weight(self) -> Int4Weight:
        """The stored levels, scales and minimums, unpacked to [out, ...]."""
        return Int4Weight(*unpack_int4(self.qweight, self.params, self.out_features))

    def dequantize(self) -> torch.Tensor:
        """The weight the layer multiplies by, float32 [out, in]."""
        return dequantize_groups(self.int4_weight(), self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self.kernel == "cpu":
            y = packed_gemm.packed_linear(
                x.float().contiguous(), self.qweight, self.params, self.bias, self.out_features
            )
        else:
            y = F.linear(x.float(), self.dequantize(), self.bias[: self.out_features])
        return y.to(x.dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] projection: [num_tokens, in] -> [num_tokens, out / 2], in the
        C++ GEMM's epilogue where the halves are whole panels (see Bf16Linear.silu_and_mul)."""
        if self.kernel != "cpu" or self.out_features % (2 * PANEL):
            return split_silu_mul(self(x))
        y = packed_gemm.packed_linear_silu_mul(
            x.float().contiguous(), self.qweight, self.params, self.bias, self.out_features
        )
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        zp = ", zero point" if self.zero_point else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}{zp}, kernel={self.kernel}"
        )
