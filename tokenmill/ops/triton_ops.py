"""Where the decoder layer's fused element-wise ops come from on CUDA: the Triton kernels of
triton_fused.py, when triton is installed.

Each caller asks `triton_ops(x)` and takes its other path (C++ on CPU, PyTorch elsewhere) when the
answer is None. triton is imported on the first CUDA call only: machines without it still import
tokenmill."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import ModuleType

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_forced = False  # tests: CPU tensors too, with the kernels under TRITON_INTERPRET=1


def triton_ops(x: torch.Tensor) -> ModuleType | None:
    """The triton_fused module for a float32/float16/bfloat16 CUDA tensor `x` when triton imports, else None."""
    if x.dtype not in _DTYPES or not (x.is_cuda or _forced):
        return None
    return _load()


@functools.cache
def _load() -> ModuleType | None:
    try:
        from tokenmill.ops import triton_fused
    except Exception:  # noqa: BLE001 (no triton, or a broken install, which raises anything): PyTorch runs instead
        return None
    return triton_fused


@contextlib.contextmanager
def force_triton_ops() -> Iterator[None]:
    """Tests only: `triton_ops` answers for CPU tensors too (run the kernels with TRITON_INTERPRET=1)."""
    global _forced
    previous, _forced = _forced, True
    try:
        yield
    finally:
        _forced = previous
