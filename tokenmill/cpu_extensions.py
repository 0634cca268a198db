"""Our C++ CPU kernels, compiled on first use with torch's extension builder and cached
(in TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default).

    paged_decode: decode attention over the paged KV cache (attention/csrc/paged_decode.cpp)
    cpu_ops:      fused add+RMSNorm, SiLU-and-mul, in-place rotary (models/layers/csrc/cpu_ops.cpp)"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_ROOT = Path(__file__).parent
SOURCES = {
    "paged_decode": _ROOT / "attention" / "csrc" / "paged_decode.cpp",
    "cpu_ops": _ROOT / "models" / "layers" / "csrc" / "cpu_ops.cpp",
}


@functools.cache
def load(name: str) -> ModuleType | None:
    """The compiled module, or None (with a warning) where no compiler is available: callers then
    use their pure-PyTorch path."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name=f"tokenmill_{name}",
            sources=[str(SOURCES[name])],
            extra_cflags=[
                "-O3", "-march=native", "-fopenmp",
                "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
            ],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(_ROOT / "csrc")],
            verbose=False,
        )
    except Exception as exc:  # no compiler or ninja: fall back to PyTorch ops
        logger.warning("could not build the C++ kernel %r (%s); using PyTorch ops instead", name, exc)
        return None
