"""The C++ GEMM over packed int8 / bf16 weights (csrc/packed_gemm.cpp), compiled on first use with
torch's extension builder and cached (in TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default).
It registers `torch.ops.tokenmill_quant.packed_linear`."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from tokenmill import cpu_extensions

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "packed_gemm.cpp"


@functools.cache
def available() -> bool:
    """True once the kernel is built and loaded; False (with a warning) where no compiler is available."""
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name="tokenmill_packed_gemm",
            sources=[str(_SOURCE)],
            extra_cflags=[*cpu_extensions.CFLAGS, cpu_extensions.headers_flag()],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(cpu_extensions.HEADERS)],  # packed_gemm.h, shared with the decode stack
            is_python_module=False,  # registers a torch op; no pybind11, so it builds in seconds
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 (no compiler, no ninja: fall back, never fail the load)
        logger.warning("could not build the C++ packed GEMM (%s); packed layers dequantize on the fly", exc)
        return False
    return True


def isa() -> str:
    """What the built GEMM runs: "avx512" (AVX-512 BF16 and VNNI dot products at every row count; bf16
    layers round their activations to bf16), "avx2" (float32 arithmetic; from 512 rows a widened
    float32 GEMM), "scalar", or "none" where it could not be built."""
    import torch

    return str(torch.ops.tokenmill_quant.packed_gemm_isa()) if available() else "none"
