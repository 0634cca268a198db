"""A mixture-of-experts layer's experts packed for the C++ op (ops/moe.py): every expert's gate/up and
down GEMMs, the activation and the weighted sum per token in one call.

    experts = PackedExperts.from_weights(w13, w2, "int8")         # w13 [E, 2 I, H], w2 [E, H, I] float
    out = experts(x, topk_ids, topk_weights)                      # as FusedExperts' forward

The weights are stacked packed_gemm layouts (quant/panels.py), one per kind:
- "bfloat16": bf16 panels (k pairs for AVX-512 BF16 and AMX builds, interleaved for AVX2);
- "float32": float32 panels (float32 FMAs, each output one sum in k order);
- "int8": per-channel symmetric int8 (quant/int8.py's quantization);
- "int4": 4-bit groups (quant/int4.py's), or any grouped weights from a GGUF file (`from_grouped`).
The intermediate size is padded to whole panels of 16 (zero gate/up rows and down columns: silu(0) * 0
adds nothing), so the gate and up halves pair panel for panel for the GEMM's silu epilogue."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.communication import all_reduce_max_
from tokenmill.ops import moe, packed_gemm
from tokenmill.quant.grouped import GroupedWeight, _whole_activation_groups, check_grouped
from tokenmill.quant.int4 import DEFAULT_GROUP_SIZE, quantize_groups
from tokenmill.quant.panels import PANEL, pack_bf16, pack_f32, pack_grouped, pack_int8

KINDS = ("bfloat16", "float32", "int8", "int4")


class PackedExperts(nn.Module):
    """forward(x [T, H], topk_ids [T, k] int64, topk_weights [T, k] float32) -> [T, H] in x's dtype: the
    sum over the k chosen experts of weight * down(silu(gate(x)) * up(x)), as FusedExperts computes it
    (under tensor parallelism a partial sum the caller all-reduces)."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor

    def __init__(
        self,
        w13: torch.Tensor,  # [E, 2 I_pad / 16, KP, width] packed [gate | up] panels
        s13: torch.Tensor,  # [E, 2 I_pad] float32 per-channel scale, or grouped params [E, P, G, (2,) 16]
        w2: torch.Tensor,  # [E, ceil(H / 16), KP2, width] packed down panels
        s2: torch.Tensor,  # as s13, for w2
        hidden_size: int,
        intermediate_size: int,  # I_pad, a multiple of 16
        kind: str,
    ) -> None:
        super().__init__()
        if not moe.available():
            raise ValueError("the C++ mixture-of-experts op could not be built here; keep FusedExperts.")
        self.num_experts, self.hidden_size, self.intermediate_size = w13.shape[0], hidden_size, intermediate_size
        self.kind = kind
        self.register_buffer("w13", w13)
        self.register_buffer("s13", s13)
        self.register_buffer("w2", w2)
        self.register_buffer("s2", s2)

    @classmethod
    def from_weights(
        cls,
        w13: torch.Tensor,  # [E, 2 I, H]: each expert's gate rows, then its up rows
        w2: torch.Tensor,  # [E, H, I]
        kind: str,
        group_size: int | None = None,
        zero_point: bool = False,
        row_parallel: bool = False,
    ) -> PackedExperts:
        """Pack (and for int8 / int4 quantize) float expert weights. group_size, zero_point: int4's
        settings; row_parallel: w2 holds this tensor-parallel rank's input columns (int8's per-row
        scales are then agreed across ranks, as for a row-parallel linear)."""
        if kind not in KINDS:
            raise ValueError(f"unknown expert weight kind {kind!r}; use one of {KINDS}.")
        num_experts, hidden_size = w2.shape[0], w2.shape[1]
        w13, w2 = _pad_intermediate(w13.detach(), w2.detach())
        intermediate = w2.shape[2]
        if kind == "int4":
            groups = DEFAULT_GROUP_SIZE if group_size is None else group_size
            gate_up = _stack_grouped(quantize_groups(_rows(w13), groups, zero_point), num_experts)
            down = _stack_grouped(quantize_groups(_rows(w2), groups, zero_point), num_experts)
            return cls(*gate_up, *down, hidden_size, intermediate, kind)
        if kind == "int8":
            packed13, s13 = _int8(w13, False)
            packed2, s2 = _int8(w2, row_parallel)
            return cls(packed13, s13, packed2, s2, hidden_size, intermediate, kind)
        packed13, packed2 = _pack_float(_rows(w13), kind), _pack_float(_rows(w2), kind)
        ones13 = torch.ones(num_experts, packed13.shape[0] // num_experts * PANEL)
        ones2 = torch.ones(num_experts, packed2.shape[0] // num_experts * PANEL)
        return cls(
            _per_expert(packed13, num_experts),
            ones13,
            _per_expert(packed2, num_experts),
            ones2,
            hidden_size,
            intermediate,
            kind,
        )

    @classmethod
    def from_grouped(
        cls,
        gate: Sequence[GroupedWeight],  # per expert, [I, H]
        up: Sequence[GroupedWeight],  # per expert, [I, H]
        down: Sequence[GroupedWeight],  # per expert, [H, I]
        hidden_size: int,
        intermediate_size: int,
    ) -> PackedExperts:
        """Experts from grouped weights as a GGUF file stores them (quant/gguf.py repacks ffn_*_exps per
        expert): each projection's experts must share one format (bits, group size, params dtype,
        minimums or not); gate and up must share theirs."""
        if not len(gate) == len(up) == len(down) > 0:
            raise ValueError("gate, up and down need one grouped weight per expert each.")
        for g, u, d in zip(gate, up, down, strict=True):
            check_grouped(g, hidden_size)
            check_grouped(u, hidden_size)
            check_grouped(d, intermediate_size)
        pad = (-intermediate_size) % PANEL
        gate_up = [w for g, u in zip(gate, up, strict=True) for w in (_pad_out(g, pad), _pad_out(u, pad))]
        down_padded = [_pad_in(d, intermediate_size + pad) for d in down]
        return cls(
            *_stack_grouped(_concat(gate_up), len(gate)),
            *_stack_grouped(_concat([_pad_out(d, (-hidden_size) % PANEL) for d in down_padded]), len(down)),
            hidden_size,
            intermediate_size + pad,
            "int4",
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, k] int64
        topk_weights: torch.Tensor,  # [T, k] float32
    ) -> torch.Tensor:  # [T, H]
        out = moe.experts(
            x.float().contiguous(),
            topk_ids.long().contiguous(),
            topk_weights.float().contiguous(),
            self.w13,
            self.s13,
            self.w2,
            self.s2,
            self.intermediate_size,
        )
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, weights={self.kind} packed"
        )


def _pad_intermediate(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up rows each, and the down columns, padded with zeros to whole panels."""
    intermediate = w2.shape[2]
    pad = (-intermediate) % PANEL
    if not pad:
        return w13, w2
    gate, up = w13.narrow(1, 0, intermediate), w13.narrow(1, intermediate, intermediate)
    w13 = torch.cat([F.pad(gate, (0, 0, 0, pad)), F.pad(up, (0, 0, 0, pad))], dim=1)
    return w13, F.pad(w2, (0, pad))


def _rows(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E * N_pad, K], each expert's rows padded to whole panels: packed as one weight, its
    panels are then each expert's panels in turn."""
    return F.pad(w, (0, 0, 0, (-w.shape[1]) % PANEL)).reshape(-1, w.shape[2])


def _pack_float(w: torch.Tensor, kind: str) -> torch.Tensor:
    """[out, in] -> bf16 panels (the built kernel's layout) or float32 panels."""
    if kind == "bfloat16":
        return pack_bf16(w.to(torch.bfloat16), pairs=packed_gemm.isa() == "avx512")
    return pack_f32(w.float())


def _per_expert(packed: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E * P, KP, width] -> [E, P, KP, width]."""
    return packed.view(num_experts, -1, *packed.shape[1:])


def _int8(w: torch.Tensor, row_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (packed [E, P, KP, 16] int8, scale [E, P * 16]), per-channel symmetric as
    quant/int8.py quantizes one layer."""
    num_experts = w.shape[0]
    rows = _rows(w.float())  # [E * N_pad, K]
    absmax = rows.abs().amax(dim=1)
    if row_parallel:
        all_reduce_max_(absmax)
    scale = (absmax / 127.0).clamp_min(1e-12)
    q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    packed = pack_int8(q, quads=packed_gemm.isa() == "avx512")
    return _per_expert(packed, num_experts), scale.view(num_experts, -1)


def _stack_grouped(weight: GroupedWeight, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's rows of one grouped weight ([E * N_pad, ...], N_pad whole panels) -> (packed
    [E, P, KP, width], params [E, P, G, (2,) 16])."""
    packed, params = pack_grouped(*_whole_activation_groups(weight))
    return _per_expert(packed, num_experts), params.view(num_experts, -1, *params.shape[1:])


def _pad_out(weight: GroupedWeight, pad: int) -> GroupedWeight:
    """Zero rows appended: level 0 with scale 0 (and minimum 0) is a zero weight in every format."""
    if not pad:
        return weight
    minimums = None if weight.minimums is None else F.pad(weight.minimums, (0, 0, 0, pad))
    return GroupedWeight(
        F.pad(weight.levels, (0, 0, 0, pad)), F.pad(weight.scales, (0, 0, 0, pad)), minimums, weight.bits
    )


def _pad_in(weight: GroupedWeight, in_features: int) -> GroupedWeight:
    """In-features padded with zero-weight groups to cover `in_features` (the padded intermediate size)."""
    missing = max(0, -(-in_features // weight.group_size) - weight.scales.shape[1])
    if not missing:
        return weight
    minimums = None if weight.minimums is None else F.pad(weight.minimums, (0, missing))
    return GroupedWeight(
        F.pad(weight.levels, (0, missing * weight.group_size)),
        F.pad(weight.scales, (0, missing)),
        minimums,
        weight.bits,
    )


def _concat(weights: Sequence[GroupedWeight]) -> GroupedWeight:
    """Grouped weights of one format stacked along the out-features."""
    first = weights[0]
    for w in weights:
        if (w.bits, w.group_size, w.scales.dtype, w.minimums is None, w.levels.shape[1]) != (
            first.bits,
            first.group_size,
            first.scales.dtype,
            first.minimums is None,
            first.levels.shape[1],
        ):
            raise ValueError("every expert of a projection must share one grouped format and in-features.")
    minimums = None if first.minimums is None else torch.cat([w.minimums for w in weights if w.minimums is not None])
    return GroupedWeight(
        torch.cat([w.levels for w in weights]), torch.cat([w.scales for w in weights]), minimums, first.bits
    )
