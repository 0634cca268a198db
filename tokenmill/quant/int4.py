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

These are the 4-bit, float16 case of quant/grouped.py's weights (GroupedWeight, GroupedLinear). The
C++ GEMM (ops/csrc/packed_int4.h, and packed_gemm_avx512.h with AVX-512 VNNI) reads two levels
per byte and quantizes the activation rows to int8 groups of 32 as the int8 path's AVX-512 kernel
does, on every instruction set: one integer dot product per (group, channel), then
d * dot + m * sum(x) in float32. Decode moves ~4.5 bits per weight (5 with minimums) at groups of 32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quant.grouped import GroupedLinear, GroupedWeight, default_kernel
from tokenmill.quant.int4_fit import fit_symmetric, fit_with_minimums

GROUP_SIZES = (32, 128)
DEFAULT_GROUP_SIZE = 32


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size {group_size} is not supported; use one of {GROUP_SIZES}.")


def quantize_groups(weight: torch.Tensor, group_size: int, zero_point: bool) -> GroupedWeight:
    """[out, in] float -> a 4-bit GroupedWeight with float16 params: each group's scale (and minimum)
    fit (int4_fit.py), rounded to float16, then every weight rounded to its nearest level (see the
    module docstring)."""
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
        return GroupedWeight(q.to(torch.uint8).view(out_features, -1), d16, m16, 4)
    d16 = fit_symmetric(groups).half()
    q = (torch.round(groups * _inverse(d16)[..., None]) + 8).clamp_(0, 15)
    return GroupedWeight(q.to(torch.uint8).view(out_features, -1), d16, None, 4)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in float32, 0 where the scale is 0 (an all-equal group: every weight at one level)."""
    d = scale.float()
    return torch.where(d != 0, 1 / d, torch.zeros_like(d))


class Int4Linear(GroupedLinear):
    """A GroupedLinear built by quantizing a float weight at load (quantization="int4")."""

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
