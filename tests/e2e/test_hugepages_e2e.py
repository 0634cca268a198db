"""Huge pages in an engine: an int8 engine keeps its packed weights in one buffer, in the order a decode
step reads them, and its KV cache on huge pages. The buffers themselves: tests/kernels/test_hugepages.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.ops import hugepages, packed_gemm
from tokenmill.quant import Int8Linear


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
