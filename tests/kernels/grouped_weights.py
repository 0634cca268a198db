"""Grouped integer weights for the kernel tests (tokenmill/quant/grouped.py): random ones of every kind,
float weights rounded into a kind, and the activations as the kernels' int8 groups see them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quant.grouped import GroupedWeight


def random_grouped(
    out_features: int, in_features: int, bits: int, dtype: torch.dtype, minimums: bool, group_size: int
) -> GroupedWeight:
    """Levels over their whole range, positive scales and signed minimums ~0.05 (a Gaussian layer's
    magnitude), K padded to whole groups."""
    in_padded = -(-in_features // group_size) * group_size
    groups = in_padded // group_size
    levels = torch.randint(0, 1 << bits, (out_features, in_padded), dtype=torch.uint8)
    scales = (torch.rand(out_features, groups) * 0.1 / (1 << (bits - 4))).to(dtype)
    mins = (torch.randn(out_features, groups) * 0.05).to(dtype) if minimums else None
    return GroupedWeight(levels, scales, mins, bits)


def rounded_grouped(
    weight: torch.Tensor, bits: int, dtype: torch.dtype, minimums: bool, group_size: int
) -> GroupedWeight:
    """A float weight [out, in] rounded to the nearest level of each group's plain grid: the range in
    2 ** bits - 1 steps from its minimum, or the largest magnitude at level 2 ** (bits - 1) - 1."""
    out_features, in_features = weight.shape
    groups = F.pad(weight.float(), (0, (-in_features) % group_size)).view(out_features, -1, group_size)
    top = (1 << bits) - 1
    if minimums:
        lo, hi = groups.amin(2), groups.amax(2)
        scales, mins = ((hi - lo) / top).to(dtype), lo.to(dtype)
        step = scales.float().clamp_min(1e-12)[..., None]
        levels = torch.round((groups - mins.float()[..., None]) / step).clamp(0, top)
        return GroupedWeight(levels.to(torch.uint8).view(out_features, -1), scales, mins, bits)
    offset = 1 << (bits - 1)
    scales = (groups.abs().amax(2) / (offset - 1)).to(dtype)
    step = scales.float().clamp_min(1e-12)[..., None]
    levels = (torch.round(groups / step) + offset).clamp(0, top)
    return GroupedWeight(levels.to(torch.uint8).view(out_features, -1), scales, None, bits)


def activations_as_seen(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels' integer dot products see it: int8 groups of 32 values along K, each group's
    step max|group| / 127, x * (127 / max) rounded to nearest even in float32 (the kernels'
    arithmetic: the reciprocal is divided in float64 and rounded once, as float32 division rounds)."""
    num_rows, k = x.shape
    groups = F.pad(x, (0, (-k) % 32)).view(num_rows, -1, 32)  # [M, G, 32]
    amax = groups.abs().amax(dim=2, keepdim=True)
    inverse = (127 / amax.double()).float()
    q = torch.round(groups * inverse).nan_to_num()
    return (q * (amax / 127)).reshape(num_rows, -1)[:, :k]
