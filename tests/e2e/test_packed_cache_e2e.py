"""The packed-weight cache (tokenmill/worker/packed_cache.py): a second load of the same model reads the
packed weights from disk instead of loading and packing the checkpoint, and generates the same tokens."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.ops import packed_gemm
from tokenmill.quant import Int8Linear, PackedFloatLinear
from tokenmill.worker import model_loader, packed_cache
from tokenmill.worker.packed_cache import FOLDER

pytestmark = pytest.mark.skipif(not packed_gemm.available(), reason="nothing is packed without the C++ GEMM")

PROMPT = {"prompt_token_ids": [5, 9, 13, 2, 7]}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "llama", "llama")


@pytest.fixture
def cold_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the loads that read and pack the checkpoint (cache misses)."""
    calls: list[str] = []
    fill = model_loader._fill

    def counted(model: Any, config: Any, *args: Any) -> None:
        calls.append(config.model)
        fill(model, config, *args)

    monkeypatch.setattr(model_loader, "_fill", counted)
    return calls


def engine(folder: Path, quantization: str | None = None) -> LLM:
    return LLM(str(folder), dtype="bfloat16", quantization=quantization, max_num_seqs=4, num_kv_blocks=32)


def greedy(folder: Path, quantization: str | None = None, llm: LLM | None = None) -> list[int]:
    llm = llm or engine(folder, quantization)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def cache_files(folder: Path) -> list[Path]:
    return sorted((folder / FOLDER).glob("*.safetensors"))


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_second_load_reads_the_cache_and_generates_the_same_tokens(
    folder: Path, cold_loads: list[str], quantization: str | None
) -> None:
    first = greedy(folder, quantization)
    assert len(cold_loads) == 1 and len(cache_files(folder)) == 1
    warm = engine(folder, quantization)
    assert greedy(folder, llm=warm) == first
    assert len(cold_loads) == 1  # the second load packed nothing
    # Read into one huge-page arena in the order a decode step reads the layers, as a cold load lays them.
    model = warm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, (PackedFloatLinear, Int8Linear))]
    packed = [b for m in layers for b in m.buffers(recurse=False)]
    assert len(layers) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down per layer, and the head
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
    assert [t.data_ptr() for t in packed] == sorted(t.data_ptr() for t in packed)


def test_changed_weights_or_settings_miss_the_cache(folder: Path, cold_loads: list[str]) -> None:
    greedy(folder)
    weights = folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a rewritten checkpoint
    greedy(folder)
    greedy(folder, "int8")
    assert len(cold_loads) == 3 and len(cache_files(folder)) == 3


def test_a_damaged_cache_file_is_ignored_and_rewritten(folder: Path, cold_loads: list[str]) -> None:
    expected = greedy(folder)
    (cached,) = cache_files(folder)
    size = cached.stat().st_size
    with cached.open("r+b") as f:  # a partial file: what a killed writer could leave without the rename
        f.truncate(size // 2)
    assert greedy(folder) == expected
    assert len(cold_loads) == 2 and cache_files(folder) == [cached] and cached.stat().st_size == size
    cached.write_bytes(b"not a safetensors file")
    assert greedy(folder) == expected
    assert len(cold_loads) == 3 and cached.stat().st_size == size


def test_nothing_is_cached_where_the_disk_would_fill(
    folder: Path, cold_loads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packed_cache.shutil, "disk_usage", lambda _: SimpleNamespace(total=100, used=99, free=1))
    greedy(folder)
    assert cache_files(folder) == [] and not list((folder / FOLDER).glob(".*.tmp"))
