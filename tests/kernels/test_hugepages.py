"""Huge-page buffers: what the packed weights and the KV cache are moved into, and that nothing changes.
An engine's buffers: tests/e2e/test_hugepages_e2e.py."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.ops import hugepages

needs_madvise = pytest.mark.skipif(hugepages._madvise() is None, reason="no transparent huge pages to ask for here")


def test_gather_copies_each_tensor_into_one_buffer_in_order() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        (torch.randn(1000, 3, generator=gen) * 100).to(torch.int8),
        torch.randn(7, generator=gen),
        torch.randn(5, 33, generator=gen).to(torch.bfloat16),
        torch.randint(0, 2**15, (4096,), generator=gen, dtype=torch.int16),
    ]
    copies = hugepages.gather(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() % 64 == 0  # whole cache lines for the kernels' vector loads
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    starts = [c.data_ptr() for c in copies]
    assert starts == sorted(starts)  # the order given: a decode step's reading order
    for c, following in itertools.pairwise(copies):  # no overlap
        assert c.data_ptr() + c.numel() * c.element_size() <= following.data_ptr()


@needs_madvise
def test_a_large_buffer_starts_on_a_huge_page_boundary() -> None:
    buffer = hugepages.huge_empty(3 * hugepages.PAGE + 5)
    assert buffer.numel() == 3 * hugepages.PAGE + 5 and buffer.dtype == torch.uint8
    assert buffer.data_ptr() % hugepages.PAGE == 0


def test_zeros_is_zeroed_with_the_shape_and_dtype_asked() -> None:
    cache = hugepages.zeros((2, 300, 16, 3, 68), torch.int8)
    assert cache.shape == (2, 300, 16, 3, 68) and cache.dtype == torch.int8 and cache.is_contiguous()
    assert not cache.any()


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address` (Rss, VmFlags, ...)."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if span := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            if inside:
                break
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_zeros_touches_no_page_until_written_and_asks_for_huge_pages() -> None:
    """A KV cache of gigabytes costs nothing to allocate: the kernel zero-fills its pages on first touch."""
    cache = hugepages.zeros((2, 256, 16, 8, 64), torch.bfloat16)  # 64 MiB
    mapping = _mapping_of(cache.data_ptr())
    assert mapping["Rss"] == "0 kB"
    if hugepages._madvise() is not None:
        assert "hg" in mapping["VmFlags"].split()  # MADV_HUGEPAGE, asked before the first touch
    assert not cache.any()
    cache[1, 255].fill_(1.0)  # written: still the buffer's own memory, still all zeros elsewhere
    assert int(cache.count_nonzero()) == 16 * 8 * 64
