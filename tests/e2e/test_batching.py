"""Batch invariance, seeded sampling, n > 1, stopping, and bad input that never harms other requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import random_prompts
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_model: Path) -> LLM:
    return LLM(str(llama_model), dtype="float32", num_kv_blocks=512)


def test_greedy_output_alone_equals_output_among_32_others(llm: LLM) -> None:
    prompts = random_prompts(33, 5, 60, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    together = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    prompts = random_prompts(9, 5, 40, seed=11)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts[::-1], [other] * 8 + [seeded], use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == mixed
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate([prompts[0]], different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_blocks(llm: LLM) -> None:
    prompt = random_prompts(1, 64, 64, seed=12)[0]
    hits_before = llm.engine.kv_cache.stats.hits
    out = llm.generate(
        [prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # different seeds, different samples
    # The three siblings reuse the leader's 3 full blocks (the 4th holds the last token, recomputed).
    assert llm.engine.kv_cache.stats.hits - hits_before >= 3 * 48


def test_max_tokens_and_stop_token_ids(llm: LLM) -> None:
    prompt = random_prompts(1, 10, 10, seed=13)[0]
    free_run = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(free_run.token_ids) == 8 and free_run.finish_reason == "length"
    stop_at = free_run.token_ids[3]
    stopped = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at]), use_tqdm=False
    )[0].outputs[0]
    first = free_run.token_ids.index(stop_at)
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


def test_min_tokens_holds_back_stop_tokens(llm: LLM) -> None:
    prompt = random_prompts(1, 10, 10, seed=13)[0]
    free_run = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    stop_at = free_run.token_ids[0]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5, stop_token_ids=[stop_at]), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) >= 5
    assert stop_at not in out.token_ids[:5]


def test_sampling_metadata_is_rebuilt_only_when_it_can_change(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same requests decoding in the same order reuse the last step's sampling tensors; penalties
    (they read the outputs so far) rebuild them every step, a pending min_tokens mask until it empties."""
    from tokenmill.sample.metadata import SamplingMetadata

    calls: list[int] = []
    real = SamplingMetadata.build

    def spy(**kwargs: object) -> SamplingMetadata:
        calls.append(1)
        return real(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SamplingMetadata, "build", spy)
    prompts = random_prompts(2, 8, 8, seed=14)

    def builds(params: SamplingParams) -> int:
        calls.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
        return len(calls)

    assert builds(SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) == 1  # 6 steps, one batch
    assert builds(SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)) == 1
    assert builds(SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3)) == 6
    # outputs 0, 1 and 2 mask the stop token; from 3 on the mask is empty and stays so
    stop = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=[1], ignore_eos=True)
    calls.clear()
    llm.generate(prompts, stop, use_tqdm=False)
    assert len(calls) >= 4


@pytest.mark.parametrize(
    "bad",
    [
        lambda llm: llm.generate([[]], SamplingParams(), use_tqdm=False),
        lambda llm: llm.generate([[5] * 600], SamplingParams(max_tokens=1), use_tqdm=False),
        lambda llm: llm.generate([[5] * 10], SamplingParams(max_tokens=510), use_tqdm=False),
        lambda llm: llm.generate([[5, 99999]], SamplingParams(), use_tqdm=False),
        lambda llm: llm.generate([[5, -1]], SamplingParams(), use_tqdm=False),
        lambda llm: llm.generate([[5]], SamplingParams(logit_bias={100000: 1.0}), use_tqdm=False),
        lambda llm: SamplingParams(max_tokens=0),
        lambda llm: SamplingParams(max_tokens=-3),
        lambda llm: SamplingParams(temperature=-0.5),
        lambda llm: SamplingParams(top_p=0.0),
        lambda llm: SamplingParams(top_p=1.5),
        lambda llm: SamplingParams(n=0),
        lambda llm: SamplingParams(n=10**6),
    ],
)
def test_bad_input_is_a_clear_value_error_and_the_engine_keeps_serving(llm: LLM, bad) -> None:
    with pytest.raises(ValueError) as info:
        bad(llm)
    assert len(str(info.value)) > 10
    assert not llm.engine.has_unfinished()
    good = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(good[0].outputs[0].token_ids) == 3


def test_a_bad_prompt_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 6], [7, 10**7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_priority_policy_serves_lower_values_first(llama_model: Path) -> None:
    llm = LLM(str(llama_model), dtype="float32", num_kv_blocks=512, max_num_seqs=1, scheduling_policy="priority")
    prompts = random_prompts(3, 5, 5, seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, priority=[5, 0, 3], use_tqdm=False)
    firsts = [o.metrics.first_token_time for o in outs]
    assert firsts[1] < firsts[2] < firsts[0]


def test_no_block_leaks_after_generate(llm: LLM) -> None:
    llm.generate(random_prompts(20, 1, 100, seed=15), SamplingParams(temperature=0.8, max_tokens=20), use_tqdm=False)
    pool = llm.engine.kv_cache.pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
