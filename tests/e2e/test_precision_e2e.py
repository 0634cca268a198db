"""bf16 on a CPU, through engines on tiny models: bf16 weights packed for the C++ GEMM, float32 activations
between the GEMMs (which round them to bf16 on CPUs with AVX-512 BF16), and bf16 / int8 KV caches. The
precision and cache dtype resolution alone: tests/unit/test_precision.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.loader import model_source
from tokenmill.ops import packed_gemm
from tokenmill.outputs import RequestOutput
from tokenmill.quant import Bf16Linear


def assert_same_greedy(got: list[RequestOutput], want: list[RequestOutput], logprob_tol: float) -> None:
    """Same greedy tokens; every top logprob of `want` within `logprob_tol` in `got`."""
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_lp, w_lp in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            for tok, lp in w_lp.items():
                assert abs(g_lp[tok].logprob - lp.logprob) < logprob_tol


def test_rounded_weights_model_runs_the_bf16_weights_in_float32(
    llama_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_source, "cpu_has_bf16", lambda: False)
    llm = LLM(model=str(llama_model), dtype="bfloat16", num_kv_blocks=64)
    assert llm.config.model.dtype == "float32" and llm.config.model.weight_dtype == "bfloat16"
    params = dict(llm.engine.runner.model.named_parameters())
    for name, param in params.items():
        assert param.dtype == torch.float32, name
        assert torch.equal(param, param.bfloat16().float()), f"{name} is not bf16-representable"
    fp32 = LLM(model=str(llama_model), dtype="float32", num_kv_blocks=64)
    fp32_params = dict(fp32.engine.runner.model.named_parameters())
    assert any(not torch.equal(params[n], fp32_params[n]) for n in params)  # the rounding did something
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def round_gemm_inputs_to_bf16(llm: LLM) -> None:
    """Make a model of float32 layers see its GEMM inputs as the AVX-512 BF16 kernel does: rounded to bf16."""
    model = llm.engine.runner.model
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    logits = model.compute_logits
    model.compute_logits = lambda hidden: logits(hidden.bfloat16().float())


@pytest.mark.skipif(not packed_gemm.available(), reason="the C++ packed GEMM could not be built here")
def test_packed_bf16_weights_decode_like_the_rounded_fp32_weights(
    llama_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel builds, the linear layers keep their bf16 weights packed (half the bytes to
    stream per decode step); the numbers are those of the rounded fp32 weights (with GEMM inputs
    rounded to bf16 where the kernel uses bf16 dot products)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [[1, 2, 3, 4], list(range(5, 40))]
    packed = LLM(model=str(llama_model), dtype="bfloat16", num_kv_blocks=64)
    linears = [m for m in packed.engine.runner.model.modules() if isinstance(m, (nn.Linear, Bf16Linear))]
    assert linears and all(isinstance(m, Bf16Linear) for m in linears)
    got = packed.generate(prompts, params, use_tqdm=False)
    isa = packed_gemm.isa()
    monkeypatch.setattr(packed_gemm, "available", lambda: False)
    rounded = LLM(model=str(llama_model), dtype="bfloat16", num_kv_blocks=64, enforce_eager=True)
    assert not any(isinstance(m, Bf16Linear) for m in rounded.engine.runner.model.modules())
    if isa == "avx512":
        round_gemm_inputs_to_bf16(rounded)
    want = rounded.generate(prompts, params, use_tqdm=False)
    # With bf16 inputs, a last-bit difference in a float32 sum can round an activation the other way
    # (one bf16 step): measured up to 9e-3, against 4e-2 and other greedy tokens with float32 inputs.
    assert_same_greedy(got, want, logprob_tol=2e-2 if isa == "avx512" else 1e-3)


def test_bf16_kv_cache_holds_twice_the_blocks_and_decodes_like_float32(
    llama_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same memory budget holds twice the bf16 blocks; greedy tokens match a float32 cache and
    logprobs stay within bf16 rounding of the keys and values."""
    monkeypatch.setattr(model_source, "cpu_has_bf16", lambda: False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [[1, 2, 3, 4], list(range(5, 40))]
    half = LLM(model=str(llama_model), dtype="bfloat16", kv_cache_memory_gb=0.01)
    full = LLM(model=str(llama_model), dtype="bfloat16", kv_cache_memory_gb=0.01, kv_cache_dtype="float32")
    assert half.config.cache.kv_cache_dtype == "bfloat16" and full.config.cache.kv_cache_dtype == "float32"
    assert all(c.dtype == torch.bfloat16 for c in half.engine.runner.kv_caches)
    assert half.engine.num_blocks == pytest.approx(2 * full.engine.num_blocks, abs=1)
    got = half.generate(prompts, params, use_tqdm=False)
    want = full.generate(prompts, params, use_tqdm=False)
    assert_same_greedy(got, want, logprob_tol=5e-2)


def test_int8_kv_cache_holds_more_blocks_and_decodes_like_bf16(tmp_path: Path) -> None:
    """An int8 cache (per token and head scales) holds 2D / (D + 4) times the bf16 blocks in the same
    memory; greedy tokens equal a float32 cache's and logprobs stay close (measured up to 0.07, bf16's
    0.05), through prompt chunks after a cached prefix, the fused decode stack and the layer-by-layer
    path. (Against float32: a bf16 cache itself flips a near tie of this model.)"""
    folder = make_tiny_model(tmp_path / "qwen3", "qwen3")  # head_dim 32, GQA 4 on 2
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [[1, 2, 3, 4], list(range(5, 60)), list(range(5, 60)) + [7, 8, 9, 10, 11]]  # the last hits the cache
    half = LLM(model=str(folder), dtype="bfloat16", kv_cache_memory_gb=0.01)
    if not half.engine.runner.backend.serves_int8_cache(16, 2, 32):  # type: ignore[attr-defined]
        pytest.skip("an int8 cache needs the AVX-512 BF16 attention kernel")
    full = LLM(model=str(folder), dtype="bfloat16", kv_cache_memory_gb=0.01, kv_cache_dtype="float32")
    want = [full.generate([p], params, use_tqdm=False)[0] for p in prompts]
    for eager in (False, True):
        int8 = LLM(
            model=str(folder), dtype="bfloat16", kv_cache_memory_gb=0.01, kv_cache_dtype="int8", enforce_eager=eager
        )
        assert all(c.dtype == torch.int8 and c.shape[-1] == 36 for c in int8.engine.runner.kv_caches)
        assert int8.engine.num_blocks == pytest.approx(half.engine.num_blocks * 64 / 36, abs=2)  # each floored
        got = [int8.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert got[2].metrics is not None and got[2].metrics.num_cached_tokens > 0
        for g, w in zip(got, want):  # the third of the top 3 may differ: compare the tokens both list
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for g_lp, w_lp in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
                assert all(abs(g_lp[t].logprob - w_lp[t].logprob) < 0.1 for t in g_lp.keys() & w_lp.keys())


def test_int8_kv_cache_is_refused_where_no_kernel_reads_it(llama_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs .* head_dim 32, 64 or 128 .*16"):
        LLM(model=str(llama_model), kv_cache_dtype="int8", num_kv_blocks=8)  # head_dim 16
    folder = make_tiny_model(tmp_path / "qwen3", "qwen3")  # head_dim 32: only the backend is wrong
    with pytest.raises(ValueError, match="needs the 'cpu' attention backend.*backend torch_ref"):
        LLM(model=str(folder), kv_cache_dtype="int8", attention_backend="torch_ref", num_kv_blocks=8)
