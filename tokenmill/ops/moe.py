"""Every expert of a mixture-of-experts layer in one C++ call (csrc/moe.h, built by build.py as the
torch op library `moe`): the (token, expert) rows grouped by expert, each expert's gate/up GEMM with
silu(gate) * up, its down GEMM and the weighted sum per token, in one parallel region. The expert
weights are stacked packed_gemm layouts (quant/panels.py; quant/experts.py packs them)."""

from __future__ import annotations

import torch

from tokenmill.ops import build, packed_gemm


def available() -> bool:
    """True once the op is built and loaded; False (with a warning) where it cannot be built."""
    return packed_gemm.available() and build.load_ops("moe")


def experts(
    x: torch.Tensor,  # [T, H] float32, contiguous
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, 2 I / 16, KP, width]: each expert's [gate | up] panels
    s13: torch.Tensor,  # [E, 2 I] float32 per-channel scale, or grouped params [E, P, G, (2,) 16]
    w2: torch.Tensor,  # [E, P2, KP2, width]: each expert's down panels
    s2: torch.Tensor,  # as s13, for w2
    intermediate: int,  # I, a multiple of 16
) -> torch.Tensor:
    """sum over the k chosen experts of weight * down(silu(gate(x)) * up(x)): [T, H] float32. int8 experts
    take AMX tiles where the packed GEMM's do (packed_gemm.set_amx switches both)."""
    amx = bool(torch.ops.tokenmill_quant.packed_gemm_amx())
    return torch.ops.tokenmill_moe.experts(x, topk_ids, topk_weights, w13, s13, w2, s2, intermediate, amx)
