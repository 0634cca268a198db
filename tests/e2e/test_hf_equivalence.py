"""Greedy tokens equal to HF transformers, and logprobs close, on tiny random models of every family,
under every scheduling situation: one prompt, many at once, chunked prefill, preemption, prefix hits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernels.avx2_rerun import avx2_rerun_test
from tests.tiny_models import hf_greedy, hf_model, random_prompts
from tokenmill import LLM, SamplingParams

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def engine(folder: Path, **kwargs: object) -> LLM:
    defaults: dict[str, object] = dict(dtype="float32", num_kv_blocks=512, block_size=16)
    defaults.update(kwargs)
    return LLM(str(folder), **defaults)


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def hf_outputs(tiny_model: Path) -> dict[str, list[list[int]]]:
    """HF's greedy continuations of the prompt sets used below, computed once per family."""
    model = hf_model(tiny_model)
    sets = {
        "mixed": random_prompts(34, 1, 90, seed=1),
        "long": random_prompts(4, 100, 200, seed=2),
    }
    return {name: [hf_greedy(model, p, MAX_NEW) for p in prompts] for name, prompts in sets.items()} | {
        f"{name}_prompts": prompts
        for name, prompts in sets.items()  # type: ignore[misc]
    }


def test_one_prompt_matches_hf(tiny_model: Path, hf_outputs: dict) -> None:
    llm = engine(tiny_model)
    prompt = hf_outputs["mixed_prompts"][0]
    assert tokens(llm.generate([prompt], GREEDY, use_tqdm=False)) == [hf_outputs["mixed"][0]]


def test_many_prompts_at_once_match_hf(tiny_model: Path, hf_outputs: dict) -> None:
    llm = engine(tiny_model)
    assert tokens(llm.generate(hf_outputs["mixed_prompts"], GREEDY, use_tqdm=False)) == hf_outputs["mixed"]


def test_chunked_prefill_matches_hf(tiny_model: Path, hf_outputs: dict) -> None:
    # A 32-token budget splits every long prompt into several chunks that share steps with decodes.
    llm = engine(tiny_model, max_num_batched_tokens=32)
    assert tokens(llm.generate(hf_outputs["long_prompts"], GREEDY, use_tqdm=False)) == hf_outputs["long"]


def test_preemption_matches_hf(tiny_model: Path, hf_outputs: dict) -> None:
    # 24 blocks of 4 tokens cannot hold 34 sequences at once: requests are preempted and recomputed.
    llm = engine(tiny_model, num_kv_blocks=40, block_size=4)
    outputs = llm.generate(hf_outputs["mixed_prompts"], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert tokens(outputs) == hf_outputs["mixed"]
    assert llm.engine.kv_cache.pool.num_free_blocks == 40


def test_prefix_cache_hits_match_hf(tiny_model: Path) -> None:
    model = hf_model(tiny_model)
    prefix = random_prompts(1, 64, 64, seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(6, 1, 20, seed=4)]
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    llm = engine(tiny_model)
    first = tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False))
    rest = tokens(llm.generate(prompts[1:], GREEDY, use_tqdm=False))
    stats = llm.engine.kv_cache.stats
    assert stats.hits >= 5 * 64  # every later request found the 64-token prefix (4 full blocks)
    assert first + rest == expected


@torch.inference_mode()
def test_logprobs_close_to_hf(tiny_model: Path) -> None:
    prompt = random_prompts(1, 30, 30, seed=5)[0]
    model = hf_model(tiny_model)
    llm = engine(tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    full = prompt + out.outputs[0].token_ids
    ref = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)  # [len, vocab]
    # Prompt token i is predicted by position i - 1; the first has no logprob.
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry is not None and prompt[i] in entry
        assert entry[prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
    sample_lps = out.outputs[0].logprobs
    assert sample_lps is not None and len(sample_lps) == 6
    for j, entry in enumerate(sample_lps):
        pos = len(prompt) + j - 1
        token = full[pos + 1]
        assert entry[token].logprob == pytest.approx(ref[pos, token].item(), abs=1e-4)
        assert entry[token].rank == 1  # greedy picks the top token
        top3 = ref[pos].topk(3).indices.tolist()
        assert set(top3) <= set(entry)


def test_reference_and_fast_attention_agree(llama_model: Path) -> None:
    prompts = random_prompts(8, 1, 80, seed=6)
    fast = tokens(engine(llama_model, max_num_batched_tokens=48).generate(prompts, GREEDY, use_tqdm=False))
    ref = tokens(
        engine(llama_model, max_num_batched_tokens=48, attention_backend="torch_ref").generate(
            prompts, GREEDY, use_tqdm=False
        )
    )
    assert fast == ref


# The same HF checks on the AVX2 kernels (paged decode, fused ops, the AVX2 GEMM), whatever the CPU here;
# one family (biases, tied head) keeps it short.
test_the_avx2_build_passes_these_tests = avx2_rerun_test(__file__, select="qwen2 and not moe")
