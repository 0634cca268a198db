"""CPU tensors on 2 MiB pages (Linux transparent huge pages), for the memory a decode step streams.

A CPU decode step reads every packed weight once and the KV cache blocks of every sequence. On 4 KiB
pages a 134 MB model spans ~33,000 pages, each a TLB miss, and the hardware prefetchers stop at page
boundaries; cache blocks lie anywhere in a pool of gigabytes, so nearly every block read misses the
TLB. Where the kernel's huge pages are "madvise" (Debian's default), memory gets them only when asked
before it is first touched: `huge_empty` asks (madvise MADV_HUGEPAGE) for a 2 MiB-aligned range. The KV
cache (`zeros`) and the packed weights (`gather`: one buffer, in the order a decode step reads them)
live there.

The buffers are fresh anonymous mappings, which the kernel zero-fills a page at a time when first
touched: a KV cache of gigabytes costs nothing to allocate, and only the blocks a request writes ever
become resident.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import sys
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

PAGE = 2 << 20  # bytes of a huge page (x86-64, arm64 with 4 KiB base pages)
_MADV_HUGEPAGE = 14  # linux/mman.h
_ALIGN = 64  # bytes between gathered tensors: whole cache lines, as the kernels' vector loads want


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise where huge pages can be asked for, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_empty(nbytes: int) -> torch.Tensor:
    """A [nbytes] uint8 CPU tensor of zeros whose pages nothing has touched yet, on huge pages where
    the OS gives them: the whole 2 MiB pages inside it are asked for before the first touch."""
    if nbytes < PAGE or not hasattr(mmap, "MAP_ANONYMOUS"):  # small: the heap's; Windows: no flags
        return torch.zeros(nbytes, dtype=torch.uint8)
    madvise = _madvise()
    length = (nbytes + PAGE - 1) // PAGE * PAGE  # whole pages, all inside the mapping wherever it starts
    # Private: a shared anonymous mapping is shmem, which gets huge pages under other rules.
    mapping = mmap.mmap(-1, length + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive; unmapped with the last view
    start = -raw.data_ptr() % PAGE
    if madvise is not None and madvise(raw.data_ptr() + start, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d): 4 KiB pages", ctypes.get_errno())
    return raw[start : start + nbytes]  # a view: keeps `raw` alive


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on huge pages where the OS gives them (see huge_empty); its pages become
    resident only as they are written."""
    return huge_empty(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def arena(sizes: list[int]) -> list[torch.Tensor]:
    """[size] uint8 slots laid out one after another, each 64-byte aligned, in one huge-page buffer (see
    huge_empty); the buffer lives as long as any of them."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += (size + _ALIGN - 1) // _ALIGN * _ALIGN
    buffer = huge_empty(total)
    return [buffer[offset : offset + size] for offset, size in zip(offsets, sizes)]


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (same shapes and dtypes, contiguous) in one arena, in the order given."""
    copies = []
    for t, slot in zip(tensors, arena([t.nbytes for t in tensors])):
        copy = slot.view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies
