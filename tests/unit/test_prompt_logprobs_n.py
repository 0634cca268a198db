"""Prompt logprobs with n > 1: the first sample computes them once for all, the siblings take the
prompt's blocks from the prefix cache, every choice gets the same logprobs, and their token texts are
decoded once per token id. A fake runner, no model; block size 4."""

from __future__ import annotations

from collections import Counter
from typing import cast

from transformers import PreTrainedTokenizerBase

from tests.unit.test_scheduler import BS, FakeRunner, make_scheduler
from tokenmill.engine.input_processor import InputProcessor, PreparedRequest
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.token_texts import token_texts
from tokenmill.outputs import (
    EngineCoreOutput,
    Logprob,
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.scheduler import AdmissionLimits

PROMPT = list(range(100, 117))  # 17 tokens: four full blocks, so a cache hit covers 16
MAX_TOKENS = 3


def prompt_entry(position: int) -> TokenLogprobs | None:
    """What the fake runner reports for one prompt position (None for the first, as the real one)."""
    if position == 0:
        return None
    return {PROMPT[position]: Logprob(-float(position), rank=1), 7: Logprob(-100.0 - position, rank=2)}


class PromptLogprobsRunner(FakeRunner):
    """The scheduler tests' fake runner, plus an entry per prompt position computed this step for
    the requests that ask for prompt logprobs."""

    def __init__(self) -> None:
        super().__init__()
        self.wants: dict[str, bool] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for new in out.new_requests:
            self.wants[new.req_id] = new.sampling_params.prompt_logprobs is not None
        starts = {r.req_id: r.num_computed_tokens for r in [*out.new_requests, *out.cached_requests]}
        result = super().execute(out)
        for req_id, n in out.num_scheduled_tokens.items():
            positions = range(starts[req_id], min(starts[req_id] + n, len(PROMPT)))
            if self.wants[req_id] and positions:
                result.prompt_logprobs[req_id] = [prompt_entry(p) for p in positions]
        return result


def prepare(n: int, prompt_logprobs: int | None = 1) -> PreparedRequest:
    limits = AdmissionLimits(max_model_len=64, block_size=BS, num_blocks=64)
    params = SamplingParams(n=n, max_tokens=MAX_TOKENS, prompt_logprobs=prompt_logprobs)
    return InputProcessor(None, 512, [2], limits).process("r", PROMPT, params)


def add(processor: OutputProcessor, prepared: PreparedRequest) -> None:
    child_ids = [c.req_id for c in prepared.children]
    processor.add_request("r", None, prepared.prompt_token_ids, prepared.params, child_ids)


def test_only_the_first_of_n_samples_asks_for_prompt_logprobs() -> None:
    prepared = prepare(n=3, prompt_logprobs=2)
    assert prepared.params.prompt_logprobs == 2  # the request still wants them, for every choice
    assert [c.sampling_params.prompt_logprobs for c in prepared.children] == [2, None, None]
    assert [c.prefill_leader for c in prepared.children] == [None, prepared.children[0], prepared.children[0]]


def test_n_samples_with_prompt_logprobs_compute_the_prompt_once_and_share_its_logprobs() -> None:
    scheduler, runner, processor = make_scheduler(), PromptLogprobsRunner(), OutputProcessor(None)
    prepared = prepare(n=3)
    add(processor, prepared)
    for child in prepared.children:
        scheduler.add_request(child)
    final: RequestOutput | None = None
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        results, _ = processor.process(scheduler.update_from_output(out, runner.execute(out)))
        final = next((r for r in results if r.finished), final)
    # The first sample computes all 17 prompt tokens; the siblings find 16 in the cache, compute 1 each.
    assert scheduler.kv_cache.stats.hits == 2 * 16
    decode_steps = 3 * (MAX_TOKENS - 1)
    assert scheduler.stats.num_scheduled_tokens == len(PROMPT) + 2 * 1 + decode_steps
    assert final is not None and len(final.outputs) == 3
    assert final.prompt_logprobs == [prompt_entry(p) for p in range(len(PROMPT))]


def _output(req_id: str, positions: range, token: int | None = None) -> EngineCoreOutput:
    finish = None if token is None else "length"
    return EngineCoreOutput(
        req_id,
        [] if token is None else [token],
        finish_reason=finish,
        new_prompt_logprobs=[prompt_entry(p) for p in positions],
    )


def test_a_recomputed_first_sample_replaces_the_prompt_logprobs_it_had_sent() -> None:
    processor = OutputProcessor(None)
    add(processor, prepare(n=2))
    processor.process([_output("r#0", range(0, 8))])
    processor.process([_output("r#0", range(0, 8))])  # preempted, recomputed from position 0
    processor.process([_output("r#0", range(8, len(PROMPT)), token=5)])
    results, _ = processor.process([EngineCoreOutput("r#1", [6], finish_reason="length")])
    assert results[0].finished
    assert results[0].prompt_logprobs == [prompt_entry(p) for p in range(len(PROMPT))]


class CountingTokenizer:
    """Token id i decodes to "<i>"; counts the single-id decode calls."""

    def __init__(self) -> None:
        self.calls: Counter[int] = Counter()

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if len(token_ids) == 1:
            self.calls[token_ids[0]] += 1
        return "".join(f"<{i}>" for i in token_ids)


def test_prompt_logprob_texts_decode_each_token_id_once() -> None:
    tokenizer = CountingTokenizer()
    processor = OutputProcessor(cast(PreTrainedTokenizerBase, tokenizer))
    add(processor, prepare(n=1))
    for _ in range(3):  # the same positions again and again: only cache hits after the first time
        results, _ = processor.process([_output("r", range(len(PROMPT)))])
        assert results == []  # prompt logprobs alone wait for the first token: an output has them whole
    state = processor.abort("r")
    assert state is not None
    entries = [e for e in state.prompt_logprobs or [] if e is not None]
    assert [e[t].decoded_token for e in entries for t in e] == [f"<{t}>" for e in entries for t in e]
    assert set(tokenizer.calls) == {*PROMPT[1:], 7}
    assert max(tokenizer.calls.values()) == 1


def test_the_token_text_table_is_shared_per_tokenizer() -> None:
    first, second = CountingTokenizer(), CountingTokenizer()
    a, b = cast(PreTrainedTokenizerBase, first), cast(PreTrainedTokenizerBase, second)
    assert token_texts(a) is token_texts(a) and token_texts(a) is not token_texts(b)
    assert [token_texts(a)[3], token_texts(a)[3], token_texts(b)[3]] == ["<3>", "<3>", "<3>"]
    assert (first.calls[3], second.calls[3]) == (1, 1)
