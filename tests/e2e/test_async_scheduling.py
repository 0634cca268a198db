"""Async scheduling (`--async-scheduling on`): the next step is scheduled and launched before the last one
is collected, its input tokens read from the last step's samples on the device. On the CPU the launch
computes the step at once, so the overlap gains nothing here, but every piece of the machinery runs:
placeholders, inputs filled from the samples, outputs taken one step late, tokens of preempted requests
dropped. Every output must equal the engine's without it, and the greedy one HF's."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import engine_args
from tests.tiny_models import hf_greedy, hf_model, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine_args import create_engine_config
from tokenmill.outputs import RequestOutput

ENGINE = {"dtype": "float32", "max_num_seqs": 16}


def _mixed_params() -> list[SamplingParams]:
    """Greedy, seeded top-p with logprobs, stop tokens, n = 2, min_tokens and prompt logprobs."""
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=10, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[7, 11, 13, 17, 19, 23]),
        SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, min_tokens=8, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]


def _shape(outputs: list[RequestOutput]) -> list[list[tuple[Any, ...]]]:
    return [[(o.token_ids, o.finish_reason, o.logprobs) for o in out.outputs] for out in outputs] + [
        [(out.prompt_logprobs,)] for out in outputs
    ]


def _watched(llm: LLM) -> list[int]:
    """The number of steps in flight at each launch (async scheduling keeps one while it launches)."""
    seen: list[int] = []
    engine, launch = llm.engine, llm.engine.executor.launch

    def watch(sched: Any) -> None:
        seen.append(len(engine._in_flight))
        launch(sched)

    engine.executor.launch = watch  # type: ignore[method-assign]
    return seen


@pytest.fixture(scope="module")
def sync_llm(llama_model: Path) -> LLM:
    return LLM(str(llama_model), num_kv_blocks=256, async_scheduling="off", **ENGINE)


@pytest.fixture(scope="module")
def async_llm(llama_model: Path) -> LLM:
    llm = LLM(str(llama_model), num_kv_blocks=256, async_scheduling="on", **ENGINE)
    assert llm.engine.scheduler.async_scheduling
    return llm


def test_outputs_equal_the_synchronous_engines(sync_llm: LLM, async_llm: LLM) -> None:
    prompts = random_prompts(6, 5, 40, seed=21)
    params = _mixed_params()
    seen = _watched(async_llm)
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    assert _shape(got) == _shape(expected)
    assert max(seen) == 1  # steps were launched while another was in flight


def test_greedy_tokens_equal_hf(async_llm: LLM, llama_model: Path) -> None:
    prompts = random_prompts(4, 4, 30, seed=22)
    outs = async_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    model = hf_model(llama_model)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 10)


def test_chunked_prefill_and_preemption_lose_no_token(sync_llm: LLM, llama_model: Path) -> None:
    """Few KV blocks and short chunks: requests are preempted while their tokens are in flight."""
    small = LLM(
        str(llama_model),
        num_kv_blocks=14,
        max_num_batched_tokens=32,
        async_scheduling="on",
        **ENGINE,
    )
    prompts = random_prompts(8, 20, 60, seed=23)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True),
    ] * 4
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.stats.num_preemptions > 0
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_penalties_are_sampled_from_tokens_collected_first(sync_llm: LLM, async_llm: LLM) -> None:
    """A request whose sampling reads its own tokens (penalties, grammars) turns the overlap off while
    it lives: every step is collected before the next is scheduled."""
    prompts = random_prompts(3, 5, 20, seed=24)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.5, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=12, frequency_penalty=1.0, ignore_eos=True),
    ]
    seen = _watched(async_llm)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    assert seen and max(seen) == 0
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_the_served_engine_streams_the_same_tokens(llama_model: Path) -> None:
    """Through the engine process and its core loop: every streamed delta arrives, none twice."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def served(mode: str) -> list[int]:
        engine = AsyncEngine(engine_args(llama_model, async_scheduling=mode), engine_process=True)
        engine.start()
        try:
            tokens: list[int] = []
            async for out in engine.generate(engine.prepare("r", {"prompt_token_ids": list(range(5, 30))}, params)):
                tokens = out.outputs[0].token_ids
            return tokens
        finally:
            engine.shutdown()

    on, off = asyncio.run(served("on")), asyncio.run(served("off"))
    assert len(on) == 10 and on == off


@pytest.mark.parametrize(
    ("kwargs", "conflict"),
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
        ({"kv_offloading_size": 1.0}, "second KV tier"),
    ],
)
def test_on_with_a_feature_it_cannot_serve_is_a_clear_error(kwargs: dict[str, Any], conflict: str) -> None:
    args = EngineArgs(model="smollm2-135m", load_format="dummy", async_scheduling="on", **kwargs)
    with pytest.raises(ValueError, match=conflict):
        create_engine_config(args)
    auto, _ = create_engine_config(dataclasses.replace(args, async_scheduling="auto", device="cuda"))
    assert not auto.scheduler.async_scheduling  # auto turns itself off instead


def test_auto_is_on_for_cuda_only() -> None:
    args = EngineArgs(model="smollm2-135m", load_format="dummy")
    assert not create_engine_config(args)[0].scheduler.async_scheduling
    cuda = dataclasses.replace(args, device="cuda")
    assert create_engine_config(cuda)[0].scheduler.async_scheduling
    assert not create_engine_config(dataclasses.replace(cuda, async_scheduling="off"))[0].scheduler.async_scheduling
