"""Huge-page buffers: what the packed weights and the KV cache are moved into, and that nothing changes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.ops import hugepages, packed_gemm
from tokenmill.quant import Int8Linear

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


@pytest.mark.skipif(not packed_gemm.available(), reason="the C++ int8 GEMM could not be built here")
def test_an_int8_engine_keeps_its_packed_weights_in_one_buffer_in_reading_order(llama_model: Path) -> None:
    llm = LLM(str(llama_model), dtype="float32", quantization="int8", max_num_seqs=4, seed=0)
    model = llm.engine.runner.model
    packed = [m.qweight for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(packed) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down per layer, and the head
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
    assert [t.data_ptr() for t in packed] == sorted(t.data_ptr() for t in packed)
    caches = llm.engine.runner.kv_caches
    assert caches and all(not c.any() for c in caches)
    if hugepages._madvise() is not None:
        assert all(c.data_ptr() % hugepages.PAGE == 0 for c in caches if c.numel() * c.element_size() >= hugepages.PAGE)
    out = llm.generate([{"prompt_token_ids": [5, 9, 13, 2, 7]}], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
