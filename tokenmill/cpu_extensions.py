"""Our C++ CPU kernels, compiled on first use with torch's extension builder and cached
(in TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by default).

    paged_decode: decode attention over the paged KV cache (attention/csrc/paged_decode.cpp)
    cpu_ops:      fused add+RMSNorm, SiLU-and-mul, in-place rotary, sampling (models/layers/csrc/cpu_ops.cpp)
    decode_stack: every decoder layer of a decode step in one call (models/csrc/decode_stack.cpp)

The kernels themselves are headers in tokenmill/csrc/, shared by these modules."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_ROOT = Path(__file__).parent
SOURCES = {
    "paged_decode": _ROOT / "attention" / "csrc" / "paged_decode.cpp",
    "cpu_ops": _ROOT / "models" / "layers" / "csrc" / "cpu_ops.cpp",
    "decode_stack": _ROOT / "models" / "csrc" / "decode_stack.cpp",
}
HEADERS = _ROOT / "csrc"
# The same flags for every module, so a kernel compiled into two of them rounds the same in both.
# -fopenmp: at::parallel_for runs serially in code compiled without it.
CFLAGS = [
    "-O3", "-march=native", "-fopenmp",
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
]
# A build takes about a minute; a lock file older than this was left by a build that was killed.
_STALE_LOCK_S = 900.0


@functools.cache
def load(name: str) -> ModuleType | None:
    """The compiled module, or None (with a warning) where no compiler is available: callers then
    use their pure-PyTorch path."""
    from torch.utils import cpp_extension

    _remove_stale_lock(Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()), name)
    try:
        return cpp_extension.load(
            name=f"tokenmill_{name}",
            sources=[str(SOURCES[name])],
            extra_cflags=[*CFLAGS, headers_flag()],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(HEADERS)],
            verbose=False,
        )
    except Exception as exc:  # no compiler or ninja: fall back to PyTorch ops
        logger.warning("could not build the C++ kernel %r (%s); using PyTorch ops instead", name, exc)
        return None


@functools.cache
def headers_flag() -> str:
    """A define carrying a digest of our kernel headers: torch rebuilds a cached extension when its
    sources or flags change, not its headers, so a changed header must change the flags."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(HEADERS.glob("*.h")))).hexdigest()[:16]
    return f"-DTOKENMILL_HEADERS={digest}"


def _remove_stale_lock(root: Path, name: str) -> None:
    """torch waits forever on a build lock; one left by a killed build would hang every later start."""
    for lock in [*root.glob(f"tokenmill_{name}/lock"), *root.glob(f"*/tokenmill_{name}/lock")]:
        try:
            if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
                logger.warning("removing a stale build lock %s", lock)
                lock.unlink()
        except OSError:
            pass
