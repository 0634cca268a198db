"""The fused CPU decode stack (every layer of a decode step in one C++ call) against the same model run
layer by layer from Python (enforce_eager)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.loader import model_source
from tokenmill.ops import packed_gemm

pytestmark = pytest.mark.skipif(not packed_gemm.available(), reason="the C++ packed GEMM could not be built here")

# Different lengths, so decode steps batch sequences with different contexts and block counts.
PROMPTS = [[1, 2, 3, 4], list(range(5, 40)), list(range(100, 117))]


def _count_fused_calls(llm: LLM) -> list[int]:
    """Wraps the runner's fused decode; the returned list grows by one per fused step."""
    runner = llm.engine.runner
    fused, calls = runner.fused_decode, []
    assert fused is not None

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return fused(*args)

    runner.fused_decode = counted  # type: ignore[assignment]
    return calls


@pytest.mark.parametrize(
    "precision",
    [
        {"dtype": "float32"},
        {"dtype": "bfloat16"},
        {"dtype": "bfloat16", "kv_cache_dtype": "float32"},
        {"dtype": "bfloat16", "quantization": "int8"},
    ],
)
def test_fused_decode_matches_layer_by_layer(
    tiny_model: Path, precision: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    if "num_experts_per_tok" in config:
        pytest.skip("the fused decode stack does not take MoE layers (MoeForCausalLM decodes layer by layer)")
    if config["model_type"] in ("gemma2", "gemma3_text"):
        pytest.skip("the fused decode stack does not take window or soft-capped layers (Gemma decodes layer by layer)")
    monkeypatch.setattr(model_source, "cpu_has_bf16", lambda: False)  # packed bf16 weights on any CPU
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    # max_num_batched_tokens 16: later prompts prefill in chunks while earlier ones decode, so some
    # steps mix prompt and decode rows (layer by layer) and others are all decode (fused).
    fused = LLM(model=str(tiny_model), num_kv_blocks=64, max_num_batched_tokens=16, **precision)
    eager = LLM(model=str(tiny_model), num_kv_blocks=64, max_num_batched_tokens=16, enforce_eager=True, **precision)
    assert eager.engine.runner.fused_decode_off_reason == "enforce_eager"
    # q/k norm, partial rotary: stay on the Python path, and say why
    qk_norm = "q/k norm (Qwen3, OLMo 2) is not fused"
    off_reasons = {"qwen3": qk_norm, "olmo2": qk_norm, "phi3": "partial rotary (Phi-4-mini) is not fused"}
    if config["model_type"] in off_reasons:
        assert fused.engine.runner.fused_decode_off_reason == off_reasons[config["model_type"]]
        return
    assert fused.engine.runner.fused_decode_off_reason is None
    calls = _count_fused_calls(fused)
    got = fused.generate(PROMPTS, params, use_tqdm=False)
    want = eager.generate(PROMPTS, params, use_tqdm=False)
    assert len(calls) >= params.max_tokens - 1  # the all-decode steps took the fused path
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for token, entry in w_step.items():
                assert g_step[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


# 11 sequences: a whole bf16 row tile of 8 and a part tile, split between the threads of one region.
MANY_PROMPTS = [list(range(3 + i, 10 + 3 * i)) for i in range(11)]


def _or_skip(make: Callable[[], LLM]) -> LLM:
    """The engine, or a skip where this CPU has no AVX-512 BF16 kernel for an int8 KV cache (it is refused)."""
    try:
        return make()
    except ValueError as exc:
        if "needs the 'cpu' attention backend's AVX-512 BF16 kernel" in str(exc):
            pytest.skip("the AVX-512 BF16 attention kernel is not built here")
        raise


@pytest.mark.parametrize(
    ("precision", "prompts"),
    [
        ({}, PROMPTS),
        ({"kv_cache_dtype": "int8"}, PROMPTS),
        ({"quantization": "int8", "kv_cache_dtype": "int8"}, PROMPTS),
        ({}, MANY_PROMPTS),
        ({"quantization": "int8", "kv_cache_dtype": "int8"}, MANY_PROMPTS),
    ],
)
def test_fused_decode_with_the_avx512_attention_matches_layer_by_layer(
    tmp_path: Path, precision: dict[str, str], prompts: list[list[int]]
) -> None:
    """head_dim 32 on a bf16 or int8 cache: the stack runs a step's ops in one parallel region, its
    attention items rotating their own rows and writing them into the cache (attn::decode_attention)."""
    folder = make_tiny_model(tmp_path / "llama", "llama", head_dim=32)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    fused = _or_skip(
        lambda: LLM(model=str(folder), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=16, **precision)
    )
    if not fused.engine.runner.backend.serves_int8_cache(16, 2, 32):  # type: ignore[attr-defined]
        pytest.skip("the AVX-512 BF16 attention kernel is not built here")
    eager = LLM(
        model=str(folder),
        dtype="bfloat16",
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        enforce_eager=True,
        **precision,
    )
    assert fused.engine.runner.fused_decode_off_reason is None
    stack = fused.engine.runner.fused_decode
    calls = _count_fused_calls(fused)
    got = fused.generate(prompts, params, use_tqdm=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    assert stack._stack.one_region
    assert len(calls) >= params.max_tokens - 1
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for token, entry in w_step.items():
                assert g_step[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_fused_decode_off_where_the_model_does_not_fit(llama_model: Path) -> None:
    """The readable reference attention has no C++ decode kernel: every step runs layer by layer."""
    llm = LLM(model=str(llama_model), dtype="float32", num_kv_blocks=64, attention_backend="torch_ref")
    assert llm.engine.runner.fused_decode_off_reason == "attention backend 'torch_ref' is not the C++ CPU one"
    assert llm.engine.runner.fused_decode is None


def test_fused_decode_rebinds_a_new_kv_cache(llama_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack holds the caches it was built with; a reallocated cache must be picked up, not written
    behind the engine's back."""
    monkeypatch.setattr(model_source, "cpu_has_bf16", lambda: False)
    # No prefix caching: the new cache holds none of the old blocks.
    llm = LLM(model=str(llama_model), dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    runner = llm.engine.runner
    runner.allocate_kv_cache(runner.kv_caches[0].shape[1])  # fresh zeroed caches, same size
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert runner.fused_decode._caches[0] is runner.kv_caches[0]


def test_fused_decode_refuses_a_malformed_layer_before_keeping_it(tmp_path: Path) -> None:
    """The one-region path reads weights as raw memory inside its threads, where nothing may throw: a
    layer whose packed shapes or norm dtype are wrong is refused when it is added, and not kept."""
    from tokenmill.models.fused_decode import _packed
    from tokenmill.ops import build

    folder = make_tiny_model(tmp_path / "llama", "llama", head_dim=32)
    llm = _or_skip(
        lambda: LLM(model=str(folder), dtype="bfloat16", quantization="int8", kv_cache_dtype="int8", num_kv_blocks=64)
    )
    if not llm.engine.runner.backend.serves_int8_cache(16, 2, 32):  # type: ignore[attr-defined]
        pytest.skip("the AVX-512 BF16 attention kernel is not built here")
    model = llm.engine.runner.model
    attn, mlp, layer = model.layers[0].self_attn, model.layers[0].mlp, model.layers[0]
    stack = build.load("decode_stack").DecodeStack(
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        model.norm.eps,
        attn.scale,
        model.norm.weight,
        model.embed_tokens.weight,
        model.rotary.cos,
        model.rotary.sin,
    )
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    linears = [_packed(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    packed, scale, bias, out_features = linears[3]
    short_scale = (packed, scale[:-16], bias, out_features)
    with pytest.raises(RuntimeError, match="scale, bias"):
        stack.add_layer(*norms, *linears[:3], short_scale, attn.kv_cache)
    with pytest.raises(RuntimeError, match="input_norm"):
        stack.add_layer(norms[0].double(), norms[1], *linears, attn.kv_cache)
    assert stack.num_layers == 0
    stack.add_layer(*norms, *linears, attn.kv_cache)
    assert stack.num_layers == 1 and stack.one_region
