"""The C++ GEMM over packed int8 / bf16 / grouped 4- and 8-bit weights (csrc/packed_gemm.cpp, kernels in
csrc/packed_gemm.h and csrc/packed_int4.h), built by build.py. It registers
`torch.ops.tokenmill_quant.packed_linear` and `packed_linear_silu_mul`; the weight layouts it reads
are quant/panels.py's."""

from __future__ import annotations

import functools
import logging

import torch

from tokenmill.ops import build

logger = logging.getLogger(__name__)


def available() -> bool:
    """True once the kernel is built and loaded; False (with a warning) where no compiler is available."""
    return build.load_ops("packed_gemm")


def isa() -> str:
    """What the built GEMM runs: "avx512" (AVX-512 BF16 and VNNI dot products at every row count, bf16
    layers on AMX tiles where amx(); bf16 layers round their activations to bf16), "avx2" (float32
    arithmetic; from 512 rows a widened float32 GEMM), "scalar", or "none" where it could not be built."""
    return str(torch.ops.tokenmill_quant.packed_gemm_isa()) if available() else "none"


def amx() -> bool:
    """True where bf16 layers run on AMX tiles (csrc/packed_gemm_amx.h): build.cpu_has_amx() and the
    Linux kernel granted this process the tile state. Where the CPU has AMX but the grant was refused,
    the AVX-512 kernels run the same packed weights, and one warning says so."""
    on = available() and _amx_granted()
    if not on and build.cpu_has_amx():
        _warn_amx_refused()
    return on


def _amx_granted() -> bool:
    return bool(torch.ops.tokenmill_quant.packed_gemm_amx())


@functools.cache
def _warn_amx_refused() -> None:
    logger.warning(
        "this CPU has AMX, but the tile state was not granted (arch_prctl ARCH_REQ_XCOMP_PERM refused, or the "
        "kernel could not be built with AMX): bf16 layers run the AVX-512 dot products instead"
    )


def set_amx(on: bool) -> bool:
    """The AMX kernels (GEMMs and attention, every library: build.set_amx) on where allowed, or off, to
    measure one path against the other on the same weights; returns whether they run."""
    available()
    return build.set_amx(on)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, out_features: int
) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ the packed weight -> [M, out_features] float32, times the
    per-channel scale, plus bias (scale and bias padded to whole panels). Grouped weights (uint8 packed)
    take their float16 or float32 group scales and minimums (quant/panels.py pack_grouped) as `scale`."""
    return torch.ops.tokenmill_quant.packed_linear(x, packed, scale, bias, out_features)


def packed_linear_silu_mul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, out_features: int
) -> torch.Tensor:
    """silu(gate) * up of a packed [gate | up] projection, in the GEMM's epilogue: [M, out_features / 2]
    float32; each half must be whole panels of 16 channels."""
    return torch.ops.tokenmill_quant.packed_linear_silu_mul(x, packed, scale, bias, out_features)


def packed_linear_lora(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    out_features: int,
    silu_mul: bool,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """packed_linear of bf16 panels on AMX tiles (where amx()), or its silu(gate) * up, with LoRA adapters'
    updates added in the epilogue: `lora` = (slot, rank [M] int32 (slot -1: none), t [M, W] float32 = x A^T,
    bt [slots, R, out_features] float32, piece_end [pieces] int64: whole panels but the last)."""
    return torch.ops.tokenmill_quant.packed_linear_lora(x, packed, scale, bias, out_features, silu_mul, *lora)
