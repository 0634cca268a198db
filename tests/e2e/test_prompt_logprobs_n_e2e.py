"""Prompt logprobs with n > 1 on a tiny random llama: the prompt is computed once, and every choice's
prompt logprobs are those of the same request with n = 1."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.tiny_models import random_prompts
from tokenmill import LLM, SamplingParams

PROMPT_LEN = 64  # four blocks of 16; a sibling's cache hit covers three (the last token is recomputed)
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def llm(llama_model: Path) -> LLM:
    return LLM(str(llama_model), dtype="float32", num_kv_blocks=256)


def test_n_samples_compute_the_prompt_once_and_all_get_the_n1_prompt_logprobs(llm: LLM) -> None:
    prompt = random_prompts(1, PROMPT_LEN, PROMPT_LEN, seed=27)[0]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=3)
    hits, scheduled = llm.engine.kv_cache.stats.hits, llm.engine.scheduler.stats.num_scheduled_tokens
    three = llm.generate([prompt], dataclasses.replace(params, n=3), use_tqdm=False)[0]
    assert llm.engine.kv_cache.stats.hits - hits == 2 * 48
    prompt_work = llm.engine.scheduler.stats.num_scheduled_tokens - scheduled - 3 * (MAX_TOKENS - 1)
    assert prompt_work == PROMPT_LEN + 2 * (PROMPT_LEN - 48)  # not 3 x PROMPT_LEN
    assert len(three.outputs) == 3 and all(len(o.token_ids) == MAX_TOKENS for o in three.outputs)

    one = llm.generate([prompt], params, use_tqdm=False)[0]
    assert one.prompt_logprobs is not None and three.prompt_logprobs is not None
    assert len(three.prompt_logprobs) == PROMPT_LEN and three.prompt_logprobs[0] is None
    for ref, got in zip(one.prompt_logprobs[1:], three.prompt_logprobs[1:]):
        assert ref is not None and got is not None and got.keys() == ref.keys()
        for token, lp in ref.items():
            assert got[token].logprob == pytest.approx(lp.logprob, abs=1e-5)
            assert got[token].rank == lp.rank
