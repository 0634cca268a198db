"""Group-wise integer weights: 4- or 8-bit levels with a float scale (and optionally a minimum) per
group of 16, 32 or 128 consecutive in-features of an output channel.

    layer = GroupedLinear(GroupedWeight(levels, scales, minimums, bits=4), in_features, bias)

One format serves int4 quantized at load (quant/int4.py: bits 4, float16 params, groups of 32 or 128)
and GGUF files repacked exactly (Q4_0/Q4_1/Q8_0 with float16 params in groups of 32, Q4_K with float32
scales and minimums in groups of 32, Q6_K 8-bit with float32 scales in groups of 16):
- with minimums:    w[o, i] = scales[o, g] * levels[o, i] + minimums[o, g]
- without minimums: w[o, i] = scales[o, g] * (levels[o, i] - 2 ** (bits - 1))
with g = i // group_size. The C++ GEMM (ops/csrc/packed_int4.h, packed_gemm_avx512.h) quantizes the
activation rows to int8 groups of 32 and takes one integer dot product per (weight group, channel);
a group of 16 takes half of an activation group."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.ops import packed_gemm
from tokenmill.quant.bf16 import split_silu_mul
from tokenmill.quant.panels import GROUP, PANEL, pack_grouped, unpack_grouped

GROUP_SIZES = (16, 32, 128)
BITS = (4, 8)
PARAM_DTYPES = (torch.float16, torch.float32)


class GroupedWeight(NamedTuple):
    """A quantized [out, in] weight. group_size = in_padded // G; see the module docstring."""

    levels: torch.Tensor  # [out, in_padded] uint8, 0..15 (bits 4) or 0..255 (bits 8)
    scales: torch.Tensor  # [out, G] float16 or float32
    minimums: torch.Tensor | None  # [out, G], the scales' dtype, or None
    bits: int  # 4 or 8

    @property
    def group_size(self) -> int:
        return self.levels.shape[1] // self.scales.shape[1]


def check_grouped(weight: GroupedWeight, in_features: int) -> None:
    """Raise ValueError unless `weight` is a grouped weight of `in_features` in-features."""
    levels, scales, minimums, bits = weight
    if bits not in BITS:
        raise ValueError(f"grouped weights take {BITS} bits, not {bits}.")
    if levels.dtype != torch.uint8 or levels.dim() != 2:
        raise ValueError(f"levels must be a 2-d uint8 tensor, got {levels.dtype} {tuple(levels.shape)}.")
    if scales.dtype not in PARAM_DTYPES or scales.dim() != 2 or scales.shape[0] != levels.shape[0]:
        raise ValueError(f"scales must be [out, G] float16 or float32, got {scales.dtype} {tuple(scales.shape)}.")
    if minimums is not None and (minimums.dtype != scales.dtype or minimums.shape != scales.shape):
        raise ValueError("minimums must have the scales' shape and dtype.")
    groups = scales.shape[1]
    if groups == 0 or levels.shape[1] % groups or weight.group_size not in GROUP_SIZES:
        raise ValueError(
            f"{levels.shape[1]} padded in-features in {groups} groups: the group size must be one of {GROUP_SIZES}."
        )
    if not 0 < in_features <= levels.shape[1] or levels.shape[1] - in_features >= weight.group_size:
        raise ValueError(f"{in_features} in-features do not fit {levels.shape[1]} levels padded to whole groups.")
    if levels.numel() and int(levels.max()) >= 1 << bits:
        raise ValueError(f"levels of a {bits}-bit weight must be below {1 << bits}.")


def dequantize_grouped(weight: GroupedWeight, in_features: int) -> torch.Tensor:
    """GroupedWeight -> float32 [out, in_features], the values the kernels multiply by: scale * level
    (or scale * (level - 2 ** (bits - 1))) in float32, then + minimum."""
    out_features = weight.levels.shape[0]
    levels = weight.levels.float().reshape(out_features, -1, weight.group_size)  # [out, G, group_size]
    scales = weight.scales.float()[..., None]
    if weight.minimums is None:
        w = scales * (levels - (1 << (weight.bits - 1)))
    else:
        w = scales * levels + weight.minimums.float()[..., None]
    return w.reshape(out_features, -1)[:, :in_features]


def default_kernel(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" and packed_gemm.available() else "reference"


def _whole_activation_groups(weight: GroupedWeight) -> GroupedWeight:
    """Pad the in-features to a multiple of 32 (the activation groups) with zero-weight groups."""
    pad = (-weight.levels.shape[1]) % GROUP
    if not pad:
        return weight
    groups = pad // weight.group_size
    minimums = None if weight.minimums is None else F.pad(weight.minimums, (0, groups))
    return GroupedWeight(F.pad(weight.levels, (0, pad)), F.pad(weight.scales, (0, groups)), minimums, weight.bits)


class GroupedLinear(nn.Module):
    """y = x @ dequantize_grouped(weight).T + bias; float inputs [num_tokens, in] and outputs
    [num_tokens, out] in the input's dtype.

    `kernel` is fixed at construction: "cpu" (the C++ GEMM) or "reference" (dequantize on each call,
    then F.linear; any device); None picks "cpu" where it is built. Both store the same packed layout
    (panels.pack_grouped)."""

    qweight: torch.Tensor
    params: torch.Tensor
    bias: torch.Tensor

    def __init__(
        self, weight: GroupedWeight, in_features: int, bias: torch.Tensor | None, kernel: str | None = None
    ) -> None:
        super().__init__()
        check_grouped(weight, in_features)
        kernel = kernel or default_kernel(weight.levels.device)
        if kernel not in ("cpu", "reference"):
            raise ValueError(f"unknown grouped-weight kernel {kernel!r}; use 'cpu' or 'reference'.")
        if kernel == "cpu" and not packed_gemm.available():  # (loads the kernel's ops)
            raise ValueError("the grouped-weight 'cpu' kernel could not be built here; use kernel='reference'.")
        self.out_features, self.in_features = weight.levels.shape[0], in_features
        self.group_size, self.bits = weight.group_size, weight.bits
        self.zero_point = weight.minimums is not None
        self.kernel = kernel
        pad = (-self.out_features) % PANEL
        # [P, KP, 8] (4 bits, two levels a byte) or [P, KP, 16] (8 bits) uint8, KP a multiple of 32, and
        # [P, G, 16] (or [P, G, 2, 16] with minimums) params in the scales' dtype
        qweight, params = pack_grouped(*_whole_activation_groups(weight))
        self.register_buffer("qweight", qweight)
        self.register_buffer("params", params)
        bias = torch.zeros(self.out_features) if bias is None else bias.detach().float()
        self.register_buffer("bias", F.pad(bias, (0, pad)))  # [P * 16]

    def grouped_weight(self) -> GroupedWeight:
        """The stored weight unpacked to [out, ...] (in-features padded to a multiple of 32)."""
        return GroupedWeight(*unpack_grouped(self.qweight, self.params, self.out_features))

    def dequantize(self) -> torch.Tensor:
        """The weight the layer multiplies by, float32 [out, in]."""
        return dequantize_grouped(self.grouped_weight(), self.in_features)

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
        dtype = str(self.params.dtype).removeprefix("torch.")
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, params={dtype}{zp}, kernel={self.kernel}"
        )
