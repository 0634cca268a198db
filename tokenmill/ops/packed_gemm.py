"""The C++ GEMM over packed int8 / bf16 / grouped 4- and 8-bit weights (csrc/packed_gemm.cpp, kernels in
csrc/packed_gemm.h and csrc/packed_int4.h), built by build.py. It registers
`torch.ops.tokenmill_quant.packed_linear` and `packed_linear_silu_mul`; the weight layouts it reads
are quant/panels.py's."""

from __future__ import annotations

import torch

from tokenmill.ops import build


def available() -> bool:
    """True once the kernel is built and loaded; False (with a warning) where no compiler is available."""
    return build.load_ops("packed_gemm")


def isa() -> str:
    """What the built GEMM runs: "avx512" (AVX-512 BF16 and VNNI dot products at every row count; bf16
    layers round their activations to bf16), "avx2" (float32 arithmetic; from 512 rows a widened
    float32 GEMM), "scalar", or "none" where it could not be built."""
    return str(torch.ops.tokenmill_quant.packed_gemm_isa()) if available() else "none"


def amx() -> bool:
    """True where bf16 layers run on AMX tiles (csrc/packed_gemm_amx.h): the build has AMX-BF16 (a CPU
    with amx_bf16, TOKENMILL_CPU_ISA=native) and the kernel granted this process the tile state."""
    return available() and bool(torch.ops.tokenmill_quant.packed_gemm_amx())


def set_amx(on: bool) -> bool:
    """Switch the AMX path on (where the build and the kernel allow it) or off, for every later call
    (the weights are the same for both paths); returns amx()."""
    return available() and bool(torch.ops.tokenmill_quant.packed_gemm_set_amx(on))


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
