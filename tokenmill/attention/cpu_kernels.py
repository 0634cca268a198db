"""Our C++ CPU kernels, compiled on first use with torch's extension builder and cached
(in TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None (with a warning) where no compiler is available."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name="tokenmill_paged_decode",
            sources=[str(_SOURCE)],
            extra_cflags=[
                "-O3", "-march=native", "-fopenmp",
                "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
            ],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler or ninja: fall back to the SDPA path
        logger.warning("could not build the C++ paged decode kernel (%s); using SDPA for decode", exc)
        return None
