"""LoRA adapters served end to end: greedy tokens equal to HF + PEFT with each adapter merged, for batches
mixing the base model and two adapters (different ranks and target modules), on the layer-by-layer path
and the fused C++ decode stack, with chunked prefill and preemption; adapters beyond the resident slots
wait and are swapped in; the prefix cache never crosses adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_lora_adapter import make_adapter
from tests.tiny_models import hf_greedy, hf_model, make_tiny_model, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.lora import LoRARequest
from tokenmill.lora.adapter import TARGET_MODULES

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(llama_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two adapters (rank 4 on every module; rank 8 on q/v and the MLP) and each one's HF + PEFT merged
    greedy continuations of the prompts, with the base model's."""
    root = tmp_path_factory.mktemp("loras")
    one, model_one = make_adapter(llama_model, root / "one", seed=1)
    two, model_two = make_adapter(
        llama_model,
        root / "two",
        seed=2,
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
    )
    prompts = random_prompts(9, 3, 60, seed=3) + random_prompts(3, 70, 110, seed=4)
    refs = {"base": hf_model(llama_model), "one": model_one.merge_and_unload(), "two": model_two.merge_and_unload()}
    greedy = {name: [hf_greedy(model, p, MAX_NEW) for p in prompts] for name, model in refs.items()}
    requests = {"one": LoRARequest("one", 1, str(one)), "two": LoRARequest("two", 2, str(two)), "base": None}
    return {"prompts": prompts, "greedy": greedy, "requests": requests}


def _mixed(adapters: dict[str, Any]) -> tuple[list[list[int]], list[LoRARequest | None], list[list[int]]]:
    names = ["base", "one", "two"]
    prompts = adapters["prompts"]
    chosen = [names[i % 3] for i in range(len(prompts))]
    loras = [adapters["requests"][n] for n in chosen]
    expected = [adapters["greedy"][n][i] for i, n in enumerate(chosen)]
    return prompts, loras, expected


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="fused-decode"),
        pytest.param({"enforce_eager": True}, id="eager"),
        pytest.param({"max_num_batched_tokens": 40}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 40, "block_size": 4}, id="preemption"),
    ],
)
def test_mixed_base_and_adapters_match_peft_merged(
    llama_model: Path, adapters: dict[str, Any], options: dict[str, Any]
) -> None:
    prompts, loras, expected = _mixed(adapters)
    kwargs: dict[str, Any] = dict(dtype="float32", num_kv_blocks=256, enable_lora=True, max_lora_rank=8) | options
    with LLM(str(llama_model), **kwargs) as llm:
        assert _tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)) == expected
        assert (llm.engine.runner.fused_decode is None) == bool(options.get("enforce_eager"))
        if "block_size" in options:  # 40 blocks of 4 tokens cannot hold 12 sequences at once
            assert llm.engine.scheduler.stats.num_preemptions > 0


def test_more_adapters_than_slots_wait_and_swap(llama_model: Path, adapters: dict[str, Any]) -> None:
    """One resident slot: requests for the other adapter wait until the first's finish, then it loads; the
    first, asked for again, evicts it and loads again."""
    prompts, loras, expected = _mixed(adapters)
    with LLM(
        str(llama_model), dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=1, max_lora_rank=8
    ) as llm:
        assert _tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)) == expected
        slots = llm.engine.runner.loras
        assert slots is not None and slots.resident == [adapters["requests"]["two"]]
        # "one" comes back: it takes the slot again (read from memory: --max-cpu-loras defaults to 1 here,
        # so from disk), with the same tokens.
        again = llm.generate(prompts[:3], GREEDY, lora_request=adapters["requests"]["one"], use_tqdm=False)
        assert _tokens(again) == adapters["greedy"]["one"][:3]
        assert slots.resident == [adapters["requests"]["one"]] and list(slots.read) == [adapters["requests"]["one"]]


def test_the_prefix_cache_never_crosses_adapters(llama_model: Path, adapters: dict[str, Any]) -> None:
    prompt = adapters["prompts"][-1]  # long enough for several full blocks
    one, two = adapters["requests"]["one"], adapters["requests"]["two"]
    with LLM(str(llama_model), dtype="float32", num_kv_blocks=256, enable_lora=True, max_lora_rank=8) as llm:
        llm.generate([prompt], GREEDY, lora_request=one, use_tqdm=False)
        second = llm.generate([prompt], GREEDY, lora_request=two, use_tqdm=False)[0]
        assert second.outputs[0].token_ids == adapters["greedy"]["two"][-1]
        assert second.metrics.num_cached_tokens == 0
        again = llm.generate([prompt], GREEDY, lora_request=one, use_tqdm=False)[0]
        assert again.metrics.num_cached_tokens > 0 and again.outputs[0].token_ids == adapters["greedy"]["one"][-1]


def test_bad_lora_requests_are_clear_errors(llama_model: Path, adapters: dict[str, Any], tmp_path: Path) -> None:
    one = adapters["requests"]["one"]
    with LLM(str(llama_model), dtype="float32", num_kv_blocks=64) as plain:
        with pytest.raises(ValueError, match="serves no LoRA adapters"):
            plain.generate([[1, 2, 3]], GREEDY, lora_request=one, use_tqdm=False)
    with LLM(str(llama_model), dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=4) as llm:
        with pytest.raises(ValueError, match="above --max-lora-rank 4"):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=adapters["requests"]["two"], use_tqdm=False)
        with pytest.raises(ValueError, match="does not exist"):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path / "no")), use_tqdm=False)
        # The engine still serves after refusing them.
        out = llm.generate([adapters["prompts"][0]], GREEDY, lora_request=one, use_tqdm=False)
        assert _tokens(out) == [adapters["greedy"]["one"][0]]


def test_packed_weights_in_one_parallel_region_match_layer_by_layer(tmp_path: Path) -> None:
    """bf16 (packed) weights, head_dim 32: the fused stack adds each thread's rows' updates inside its one
    parallel region (from bf16 copies of the adapters: these adapters' values are bf16 ones, and scaled
    by a power of two); its tokens and logprobs match the layer-by-layer path's."""
    folder = make_tiny_model(tmp_path / "llama", "llama", head_dim=32)
    one, _ = make_adapter(folder, tmp_path / "one", seed=1, bf16_exact=True)
    targets = ["q_proj", "gate_proj", "down_proj"]
    two, _ = make_adapter(folder, tmp_path / "two", seed=2, bf16_exact=True, r=8, lora_alpha=16, target_modules=targets)
    loras = [LoRARequest("one", 1, str(one)), LoRARequest("two", 2, str(two)), None]
    prompts = random_prompts(9, 3, 40, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    kwargs: dict[str, Any] = dict(dtype="bfloat16", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    with LLM(str(folder), **kwargs) as fused:
        runner = fused.engine.runner
        if runner.fused_decode is None or not runner.backend.serves_int8_cache(16, 2, 32):  # type: ignore[attr-defined]
            pytest.skip("the one-region decode stack (AVX-512 GEMMs and attention) is not built here")
        got = fused.generate(prompts, params, lora_request=[loras[i % 3] for i in range(9)], use_tqdm=False)
        assert runner.fused_decode._stack.one_region
    with LLM(str(folder), enforce_eager=True, **kwargs) as eager:
        want = eager.generate(prompts, params, lora_request=[loras[i % 3] for i in range(9)], use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            for token, entry in w_step.items():
                assert g_step[token].logprob == pytest.approx(entry.logprob, abs=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # an LM head of its own; tied to the embedding
def test_embedding_and_lm_head_adapters_match_peft(tmp_path: Path, family: str) -> None:
    """An adapter of the embedding and the LM head (and q/v) beside one of the layers and the LM head and the base:
    tokens equal to PEFT's (merged where the head is not tied: merged into a tied embedding, an update
    of one would change the other too; unmerged, PEFT adapts each on its own side), on the fused decode stack (steps
    with an embedding adapter run layer by layer) and eagerly."""
    base = make_tiny_model(tmp_path / family, family)
    heads, model_heads = make_adapter(
        base, tmp_path / "heads", seed=5, target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"]
    )
    targets = [*TARGET_MODULES, "lm_head"]
    layers, model_layers = make_adapter(base, tmp_path / "layers", seed=6, target_modules=targets)
    prompts = random_prompts(6, 3, 40, seed=7)
    tied = family == "qwen2"
    adapted = [model_heads, model_layers] if tied else [model_heads.merge_and_unload(), model_layers.merge_and_unload()]
    refs = [hf_model(base), *adapted]
    loras = [None, LoRARequest("heads", 1, str(heads)), LoRARequest("layers", 2, str(layers))]
    chosen = [i % 3 for i in range(len(prompts))]
    expected = [hf_greedy(refs[c], p, MAX_NEW) for c, p in zip(chosen, prompts)]
    assert expected[1] != hf_greedy(refs[0], prompts[1], MAX_NEW)  # the adapter changes the tokens
    for eager in (False, True):
        kwargs: dict[str, Any] = dict(dtype="float32", num_kv_blocks=128, enable_lora=True, enforce_eager=eager)
        with LLM(str(base), **kwargs) as llm:
            outputs = llm.generate(prompts, GREEDY, lora_request=[loras[c] for c in chosen], use_tqdm=False)
            assert _tokens(outputs) == expected
            # Without the embedding's adapter in a step, decode steps run the fused stack (not eager).
            assert (llm.engine.runner.fused_decode is None) == eager
            own = [i for i, c in enumerate(chosen) if c == 2]
            outputs = llm.generate([prompts[i] for i in own], GREEDY, lora_request=loras[2], use_tqdm=False)
            assert _tokens(outputs) == [expected[i] for i in own]


@pytest.mark.timeout(180)  # a broken collective must fail the test, never hang CI
def test_tensor_parallel_ranks_shard_the_adapters(llama_model: Path, adapters: dict[str, Any]) -> None:
    """Two ranks: each keeps its share of every adapter (B's rows of a column-parallel layer, A's columns
    of a row-parallel one); the tokens equal HF + PEFT merged."""
    prompts, loras, expected = _mixed(adapters)
    kwargs: dict[str, Any] = dict(dtype="float32", num_kv_blocks=128, enable_lora=True, max_lora_rank=8)
    with LLM(str(llama_model), tensor_parallel_size=2, **kwargs) as llm:
        assert _tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)) == expected
