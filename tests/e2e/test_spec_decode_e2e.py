"""Speculative decoding changes how fast tokens come, never which: greedy and seeded outputs equal those
of the same engine without it, with n-gram drafts and with a draft model, through chunked prefill,
preemption, prefix hits, stops and max_tokens landing inside a run of accepted drafts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_models import hf_model, make_tiny_model, make_tiny_tokenizer, random_prompts
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.outputs import RequestOutput
from tokenmill.spec_decode.proposer import Proposal
from tokenmill.worker.model_runner import kv_cache_bytes_per_block

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3-moe"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Speculation on for every batch these tests run (the default turns it off above a few requests).
ALWAYS = {"disable_by_batch_size": 64}
NOISE = 0.005  # about half of the drafts accepted


def ngram(**extra: Any) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, **ALWAYS, **extra}


def draft(model: Path, k: int = 4) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **ALWAYS}


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so that n-gram lookup finds matches."""
    return [p * 4 + p[:3] for p in random_prompts(n, 4, 12, seed=seed)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def family_model(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(family), family)


def noisy_copy(model: Path, folder: Path, noise: float) -> Path:
    """The model with Gaussian noise of std `noise` added to every weight: a draft that often agrees."""
    hf = hf_model(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise)
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def partial_draft(family_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft that agrees with the target on some tokens and not on others: both paths are taken."""
    return noisy_copy(family_model, tmp_path_factory.mktemp("draft"), NOISE)


def engine(model: Path, spec: dict[str, Any] | None = None, **kwargs: Any) -> LLM:
    return LLM(
        str(model), dtype="float32", num_kv_blocks=kwargs.pop("num_kv_blocks", 512), speculative_config=spec, **kwargs
    )


def test_ngram_greedy_equals_no_speculation(family_model: Path) -> None:
    prompts = repetitive_prompts(32, seed=1)
    expected = tokens(engine(family_model).generate(prompts, GREEDY, use_tqdm=False))
    llm = engine(family_model, ngram())
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.stats.spec.num_draft_tokens > 0  # drafts were verified


def test_draft_model_greedy_equals_no_speculation(family_model: Path, partial_draft: Path) -> None:
    prompts = random_prompts(32, 5, 60, seed=2)
    expected = tokens(engine(family_model).generate(prompts, GREEDY, use_tqdm=False))
    llm = engine(family_model, draft(partial_draft))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    stats = llm.engine.scheduler.stats.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts accepted and drafts rejected
    assert sum(o.metrics.num_draft_tokens for o in outputs if o.metrics) == stats.num_draft_tokens


def test_a_draft_equal_to_the_target_accepts_every_greedy_draft(llama_model: Path) -> None:
    llm = engine(llama_model, draft(llama_model))
    [out] = llm.generate(random_prompts(1, 30, 30, seed=3), GREEDY, use_tqdm=False)
    stats = llm.engine.scheduler.stats.spec
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert out.metrics is not None and out.metrics.num_accepted_tokens == out.metrics.num_draft_tokens
    # Every step emits its accepted drafts and one token of its own: 24 tokens in ceil(24 / 5) + 1 steps.
    assert stats.num_drafts <= 6


@pytest.fixture(scope="module")
def llama_pair(llama_model: Path) -> tuple[LLM, LLM]:
    """The tiny llama without speculation, and with itself as a draft (every greedy draft accepted)."""
    return engine(llama_model), engine(llama_model, draft(llama_model))


def test_stop_token_inside_an_accepted_run_ends_the_output_there(llama_pair: tuple[LLM, LLM]) -> None:
    base, spec = llama_pair
    prompt = random_prompts(1, 20, 20, seed=4)
    free = tokens(base.generate(prompt, GREEDY, use_tqdm=False))[0]
    stop_at = free[6]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_at])
    [out] = spec.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].token_ids == free[: free.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 11])
def test_max_tokens_is_never_overshot(llama_pair: tuple[LLM, LLM], max_tokens: int) -> None:
    base, spec = llama_pair
    prompt = random_prompts(1, 20, 20, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    [out] = spec.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].token_ids == tokens(base.generate(prompt, params, use_tqdm=False))[0]
    assert len(out.outputs[0].token_ids) == max_tokens and out.outputs[0].finish_reason == "length"


def test_min_tokens_holds_back_a_stop_token_across_drafts(llama_pair: tuple[LLM, LLM]) -> None:
    base, spec = llama_pair
    prompt = random_prompts(1, 20, 20, seed=6)
    free = tokens(base.generate(prompt, GREEDY, use_tqdm=False))[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[free[1]], min_tokens=8)
    expected = tokens(base.generate(prompt, params, use_tqdm=False))[0]
    [out] = spec.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].token_ids == expected and len(expected) >= 8


def test_logprobs_of_accepted_tokens_match(llama_pair: tuple[LLM, LLM]) -> None:
    base, spec = llama_pair
    prompts = random_prompts(3, 10, 30, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    for want, got in zip(
        base.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    ):
        w, g = want.outputs[0], got.outputs[0]
        assert g.token_ids == w.token_ids
        assert w.logprobs is not None and g.logprobs is not None and len(g.logprobs) == len(w.logprobs) == 12
        for a, b in zip(w.logprobs, g.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


class Oracle:
    """Proposes the continuation a run without speculation produced, one token in two drafts wrong:
    drafts without a distribution (like n-gram lookup's), many kept and many rejected."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.runs = [(p, o) for p, o in zip(prompts, outputs)]
        self.calls = 0

    def propose(
        self,
        req_ids: list[str],
        token_ids: list[list[int]],
        block_ids: list[list[int]],
        max_drafts: list[int],
        params: list[SamplingParams],
    ) -> Proposal:
        drafts = []
        for tokens, n in zip(token_ids, max_drafts):
            self.calls += 1
            draft: list[int] = []
            for prompt, output in self.runs:
                if tokens[: len(prompt)] == prompt and output[: len(tokens) - len(prompt)] == tokens[len(prompt) :]:
                    draft = list(output[len(tokens) - len(prompt) :][:n])
            if draft and self.calls % 2:
                draft[self.calls % len(draft)] = (draft[self.calls % len(draft)] + 1) % 512
            drafts.append(draft)
        return Proposal(drafts, [None] * len(drafts))

    def remove_request(self, req_id: str) -> None:
        pass


def test_seeded_sampling_with_drafts_without_a_distribution_equals_no_speculation(llama_model: Path) -> None:
    """Such drafts are kept while they equal each row's own seeded sample: the tokens are those of a run
    without speculation, alone or in a batch."""
    base, spec = engine(llama_model), engine(llama_model, ngram())
    prompts = random_prompts(4, 10, 30, seed=8)
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True)
    expected = tokens(base.generate(prompts, seeded, use_tqdm=False))
    spec.engine.runner.proposer = Oracle(prompts, expected)
    assert tokens(spec.generate(prompts, seeded, use_tqdm=False)) == expected
    assert tokens(spec.generate(prompts[:1], seeded, use_tqdm=False)) == expected[:1]
    stats = spec.engine.scheduler.stats.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_chunked_prefill_and_preemption(family_model: Path, partial_draft: Path) -> None:
    prompts = random_prompts(8, 30, 70, seed=9)
    small = dict(num_kv_blocks=12, max_num_batched_tokens=32)  # 8 requests of 3 to 6 blocks: preemption
    expected = tokens(engine(family_model, **small).generate(prompts, GREEDY, use_tqdm=False))
    for spec in (ngram(), draft(partial_draft)):
        llm = engine(family_model, spec, **small)
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.engine.scheduler.stats.num_preemptions > 0


def test_prefix_cache_hits(llama_pair: tuple[LLM, LLM]) -> None:
    base, spec = llama_pair
    shared = random_prompts(1, 48, 48, seed=10)[0]
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    expected = tokens(base.generate(prompts, GREEDY, use_tqdm=False))
    first = spec.generate(prompts[:1], GREEDY, use_tqdm=False)
    second = spec.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert tokens(first + second) == expected
    assert second[0].metrics is not None and second[0].metrics.num_cached_tokens >= 48


def test_stop_string_inside_an_accepted_run(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", "llama")
    make_tiny_tokenizer().save_pretrained(model)
    base, spec = engine(model), engine(model, draft(model))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = base.generate(["The capital of"], params, use_tqdm=False)[0].outputs[0].text
    stop = free[8:11]
    cut = free[: free.index(stop)]
    stopped = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    [out] = spec.generate(["The capital of"], stopped, use_tqdm=False)
    assert out.outputs[0].text == cut and out.outputs[0].finish_reason == "stop"
    assert (
        out.outputs[0].token_ids == base.generate(["The capital of"], stopped, use_tqdm=False)[0].outputs[0].token_ids
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "unknown speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown speculative_config keys"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
    ],
)
def test_bad_configuration_is_a_clear_error(llama_model: Path, spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine(llama_model, spec)


def test_a_draft_with_another_vocabulary_is_refused(llama_model: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens"):
        engine(llama_model, draft(other))


def test_sampled_drafts_of_a_draft_equal_to_the_target_are_all_accepted(llama_pair: tuple[LLM, LLM]) -> None:
    """Rejection sampling keeps a draft with probability min(1, p/q): 1 when the draft's q is the target's p."""
    _, spec = llama_pair
    before = spec.engine.scheduler.stats.spec.num_accepted_tokens, spec.engine.scheduler.stats.spec.num_draft_tokens
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    spec.generate(random_prompts(2, 10, 30, seed=11), sampled, use_tqdm=False)
    stats = spec.engine.scheduler.stats.spec
    accepted, drafted = stats.num_accepted_tokens - before[0], stats.num_draft_tokens - before[1]
    assert drafted > 20 and accepted >= 0.95 * drafted


def test_seeded_sampled_drafts_give_the_same_tokens_alone_and_in_a_batch(
    family_model: Path, partial_draft: Path
) -> None:
    llm = engine(family_model, draft(partial_draft))
    prompts = random_prompts(4, 10, 30, seed=12)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=16, ignore_eos=True)
    batch = tokens(llm.generate(prompts, seeded, use_tqdm=False))
    alone = tokens(llm.generate(prompts[2:3], seeded, use_tqdm=False))
    assert alone[0] == batch[2]
    assert llm.engine.scheduler.stats.spec.num_accepted_tokens > 0


def test_structured_output_with_drafts_follows_the_schema_and_equals_no_speculation(tmp_path: Path) -> None:
    """The grammar's mask applies at every verified position: a draft it refuses is rejected."""
    model = make_tiny_model(tmp_path / "m", "llama")
    make_tiny_tokenizer().save_pretrained(model)
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "maximum": 999}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ["The capital of", "hello", "Answer in JSON:"]
    expected = [o.outputs[0].text for o in engine(model).generate(prompts, params, use_tqdm=False)]
    for spec in (draft(model), ngram()):
        llm = engine(model, spec)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].text for o in outputs] == expected
        for out in outputs:
            assert set(json.loads(out.outputs[0].text)) == {"color", "n"}
        assert llm.engine.scheduler.stats.spec.num_draft_tokens > 0


def test_the_draft_models_cache_counts_in_the_kv_budget(llama_pair: tuple[LLM, LLM]) -> None:
    base, spec = llama_pair
    target_only = kv_cache_bytes_per_block(spec.engine.config)
    assert base.engine.runner.kv_cache_bytes_per_block() == target_only
    assert spec.engine.runner.kv_cache_bytes_per_block() == 2 * target_only  # a draft of the same shape
    assert len(spec.engine.runner.kv_caches) == 2 * len(base.engine.runner.kv_caches)
