"""bf16 on a CPU, the resolution alone: bf16 asked for is bf16 weights with float32 activations, and the KV
cache dtype "auto" stands for. Engines on tiny models (bf16 weights packed for the C++ GEMM, bf16 and int8
KV caches): tests/e2e/test_precision_e2e.py."""

from __future__ import annotations

import pytest

from tokenmill.config import resolve_kv_cache_dtype
from tokenmill.loader import model_source
from tokenmill.loader.model_source import resolve_precision


def test_bf16_on_cpu_is_bf16_weights_with_float32_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source, "cpu_has_bf16", lambda: False)
    assert resolve_precision("bfloat16", "cpu") == ("float32", "bfloat16")
    assert resolve_precision("auto", "cpu") == ("float32", None)  # no bf16 instructions: exact fp32
    # a 16-bit checkpoint: its own precision, widened in the GEMM's registers (half fp32's bytes)
    assert resolve_precision("auto", "cpu", "bfloat16") == ("float32", "bfloat16")
    assert resolve_precision("auto", "cpu", "float16") == ("float32", "bfloat16")
    assert resolve_precision("auto", "cpu", "float32") == ("float32", None)
    assert resolve_precision("float32", "cpu") == ("float32", None)
    assert resolve_precision("bfloat16", "cuda") == ("bfloat16", None)
    monkeypatch.setattr(model_source, "cpu_has_bf16", lambda: True)
    assert resolve_precision("bfloat16", "cpu") == ("float32", "bfloat16")
    assert resolve_precision("auto", "cpu") == ("float32", "bfloat16")
    assert resolve_precision("auto", "cpu", "float32") == ("float32", "bfloat16")  # bf16 arithmetic: bf16


def test_checkpoint_dtype_reads_either_config_key() -> None:
    from transformers import LlamaConfig

    assert model_source.checkpoint_dtype(LlamaConfig(torch_dtype="float16")) == "float16"
    assert model_source.checkpoint_dtype(LlamaConfig()) is None


def test_kv_cache_dtype_auto_is_bf16_under_narrow_weights_on_cpu() -> None:
    assert resolve_kv_cache_dtype("auto", "float32", "bfloat16", None, "cpu") == "bfloat16"
    assert resolve_kv_cache_dtype("auto", "float32", None, "int8", "cpu") == "bfloat16"
    assert resolve_kv_cache_dtype("auto", "float32", None, None, "cpu") == "float32"  # exact fp32 stays exact
    assert resolve_kv_cache_dtype("auto", "bfloat16", None, None, "cuda") == "bfloat16"
    assert resolve_kv_cache_dtype("float32", "float32", "bfloat16", None, "cpu") == "float32"
    assert resolve_kv_cache_dtype("bfloat16", "float32", None, None, "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="only the CPU backend converts"):
        resolve_kv_cache_dtype("float32", "bfloat16", None, None, "cuda")
    with pytest.raises(ValueError, match="only the CPU backend converts"):
        resolve_kv_cache_dtype("float16", "float32", None, None, "cpu")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        resolve_kv_cache_dtype("fp8", "float32", None, None, "cpu")
    assert resolve_kv_cache_dtype("int8", "float32", None, "int8", "cpu") == "int8"
    with pytest.raises(ValueError, match="only by the CPU attention kernel"):
        resolve_kv_cache_dtype("int8", "bfloat16", None, None, "cuda")
