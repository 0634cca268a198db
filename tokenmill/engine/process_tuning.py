"""Process-wide settings for a long-running engine, applied once its model is loaded.

Both remove work that lands on one core while the other waits at the next parallel region."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # the largest glibc accepts on 64-bit systems


def freeze_startup_heap(collect: bool = True) -> None:
    """Move every object alive now (the model, tokenizer, imported modules: ~360k objects with
    transformers loaded) out of reach of Python's cyclic garbage collector. Its full collections
    walk all tracked objects, ~0.2 s each, several per minute of serving. Frozen objects are still
    freed by reference counting (a frozen reference cycle waits for exit), and handed back at exit
    so that shutdown finalizes them. `collect=False` skips the collection first (~0.1-0.2 s): the
    start-up's own garbage cycles are then kept until exit."""
    if collect:
        gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once per process, however many engines it builds
    atexit.register(gc.unfreeze)


def keep_freed_memory() -> None:
    """Serve a step's large temporaries (a prefill's activations: megabytes each) from memory the
    process already holds. By default glibc maps each one fresh and unmaps it when freed, and the
    kernel zero-fills every page again on the next step. Allocations up to 32 MB come from the
    heap, and the heap keeps freed memory instead of returning it (the peak stays resident)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): keep the defaults
        ok = False
    if not ok:
        logger.debug("mallopt unavailable; the allocator keeps its defaults")
