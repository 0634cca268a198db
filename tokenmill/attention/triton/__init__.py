"""Triton kernels for paged attention on GPU (and on CPU under TRITON_INTERPRET=1, for tests).

Nothing here imports triton at module import time: CI machines without it must still import
tokenmill. `triton_unavailable_reason()` says why the backend cannot be used, or None when it can.

Files: `kv_write.py` (scatter k/v into the paged cache), `prefill.py` (variable-length queries over
paged KV: prefill, chunked prefill, prefix hits, mixed batches), `decode.py` (one query per request,
split-K over the context, then a reduce), `backend.py` (`TritonBackend`, the AttentionBackend)."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_unavailable_reason() -> str | None:
    """None when triton imports; otherwise a sentence saying what is missing and how to get it. Asked
    once per process (the sampler asks every step)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'tokenmill[gpu]')"
    try:
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (a broken install raises anything from ImportError to RuntimeError)
        return f"triton is installed but fails to import: {exc!r}"
    return None
