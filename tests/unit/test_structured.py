"""Structured output without a model: llguidance grammars on a tiny trained tokenizer, the step's token
bitmask against the matcher trying each token one by one, rollback, the compile cache, bad specs, the
mask in the sampler, and where a grammar's request stops. End to end on a tiny model:
tests/e2e/test_structured_output_e2e.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from concurrent.futures import Future
from typing import Any

import llguidance
import pytest
import torch

from tests.tiny_models import make_tiny_tokenizer
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.sample.bitmask import TokenBitmask, apply_token_bitmask, bitmask_penalty
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.scheduling.request import Request, RequestStatus
from tokenmill.scheduling.scheduler import AdmissionLimits
from tokenmill.server.constraints import check_compiles
from tokenmill.server.errors import APIError
from tokenmill.structured.compiler import GrammarCompiler, spec_text
from tokenmill.structured.limits import MAX_GRAMMAR_BYTES_CEILING
from tokenmill.structured.llguidance_backend import (
    LLGuidanceBackend,
    LLGuidanceChecker,
    grammar_text,
    llguidance_grammars,
)
from tokenmill.structured.manager import StructuredOutputManager
from tokenmill.structured.waitlist import GrammarWaitlist

EOS = 2
VOCAB = 300 + 37  # the logits are wider than the tokenizer: ids from 300 on are never allowed
CPU = torch.device("cpu")
LIMITS = AdmissionLimits(max_model_len=256, block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tiny_tokenizer(300)


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer, VOCAB, [EOS])


def manager(backend: LLGuidanceBackend) -> StructuredOutputManager:
    return StructuredOutputManager(GrammarCompiler(lambda: backend), max_num_seqs=4, device=CPU)


def allowed_rows(mask: TokenBitmask, num_rows: int) -> list[set[int]]:
    """The tokens each logits row may pick once the mask is applied, read off -inf."""
    logits = torch.zeros(num_rows, VOCAB)
    apply_token_bitmask(logits, mask)
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def tried_one_by_one(matcher: llguidance.LLMatcher) -> set[int]:
    """The reference: every token the matcher accepts, each tried on its own copy."""
    return {t for t in range(VOCAB) if matcher.deep_copy().consume_token(t)}


def random_regex(rng: random.Random) -> str:
    """Characters and classes with quantifiers, no literal runs: where a grammar forces several bytes,
    llguidance allows only tokens that begin their canonical tokenization, fewer than it would accept."""

    def piece() -> str:
        if rng.random() < 0.5:
            return rng.choice(["[ab]", "[a-c]", "[0-9]", "[ab ]", "(a|b)", "[a-e]"]) + rng.choice(
                ["", "+", "*", "?", "{1,3}"]
            )
        return rng.choice("ab1 x") + rng.choice(["+", "*", "?"])

    return "".join(piece() for _ in range(rng.randint(1, 5)))


# ---------------------------------------------------------------------- the bitmask


def test_bitmask_allows_exactly_the_tokens_the_matcher_accepts_one_by_one(backend: LLGuidanceBackend) -> None:
    """Two constrained rows around an unconstrained one, token by token along random paths."""
    rng = random.Random(0)
    structured = manager(backend)
    for _ in range(6):
        specs = [StructuredOutputsParams(regex=random_regex(rng)) for _ in range(2)]
        refs = [llguidance.LLMatcher(backend.ll_tokenizer, grammar_text(s), log_level=0) for s in specs]
        structured.add_request("a", specs[0], [])
        structured.add_request("b", specs[1], [])
        live = ["a", "free", "b"]
        for _ in range(10):
            mask = structured.bitmask(live)
            assert mask is not None and mask.rows is not None and mask.rows.tolist() == [0, 2]
            got = allowed_rows(mask, 3)
            assert got[1] == set(range(VOCAB))  # the unconstrained row is untouched
            expected = [tried_one_by_one(r) for r in refs]
            assert [got[0], got[2]] == expected, specs
            assert all(t < 300 for row in expected for t in row)
            picks = [rng.choice(sorted(row)) for row in expected]
            structured.accept(live, [[picks[0]], [7], [picks[1]]])
            for ref, pick in zip(refs, picks):
                assert ref.consume_token(pick)
            if EOS in picks:
                break
        structured.remove_request("a")
        structured.remove_request("b")
    assert structured.matchers == {}


def test_a_step_with_only_constrained_rows_masks_every_row_in_order(backend: LLGuidanceBackend) -> None:
    structured = manager(backend)
    structured.add_request("x", StructuredOutputsParams(choice=["yes", "no"]), [])
    mask = structured.bitmask(["x"])
    assert mask is not None and mask.rows is None and mask.bits.shape == (1, backend.num_words)
    assert structured.bitmask(["someone else"]) is None


def test_apply_token_bitmask_bans_tokens_past_the_mask_and_leaves_other_rows() -> None:
    bits = torch.tensor([[0b1010, -1]], dtype=torch.int32)  # tokens 1, 3 and 32..63
    logits = torch.arange(3 * 70, dtype=torch.float32).reshape(3, 70)
    original = logits.clone()
    apply_token_bitmask(logits, TokenBitmask(bits, torch.tensor([1])))
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [1, 3, *range(32, 64)]  # 64..69: past the mask's two words
    assert torch.equal(logits[1, allowed], original[1, allowed])
    assert torch.equal(logits[[0, 2]], original[[0, 2]])
    assert bitmask_penalty(bits, 40).shape == (1, 40)


def test_the_penalty_equals_a_masked_fill_of_the_bits_read_one_by_one() -> None:
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, 100, generator=gen)
    logits[0, 5] = float("-inf")  # already banned (min_tokens, say): stays -inf whatever its bit
    allowed = torch.tensor([[w >> j & 1 == 1 for w in row for j in range(32)][:100] for row in bits.tolist()])
    expected = logits.masked_fill(~allowed, float("-inf"))
    apply_token_bitmask(logits, TokenBitmask(bits))
    assert torch.equal(logits, expected)


def test_a_resumed_request_replays_its_outputs_once(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    """After preemption the runner gets the request again with its outputs: the new matcher's mask is the
    one the old matcher had after accepting them step by step."""
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    outputs = tokenizer.encode('{"a": 4')
    stepwise = manager(backend)
    stepwise.add_request("r", spec, [])
    for token in outputs:
        stepwise.accept(["r"], [[token]])
    resumed = manager(backend)
    resumed.add_request("r", spec, outputs)
    a, b = stepwise.bitmask(["r"]), resumed.bitmask(["r"])
    assert a is not None and b is not None and torch.equal(a.bits, b.bits)


# ---------------------------------------------------------------------- matchers


def mask_of(matcher: Any, num_words: int) -> torch.Tensor:
    bits = torch.zeros(1, num_words, dtype=torch.int32)
    matcher.fill_bitmask(bits, 0)
    return bits


def test_rollback_returns_to_the_same_mask(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    matcher = backend.compile(spec).matcher()
    start = mask_of(matcher, backend.num_words)
    tokens = tokenizer.encode('{"a": 12}')
    for k in range(1, len(tokens) + 1):
        assert matcher.accept_tokens(tokens[:k])
        matcher.rollback(k)
        assert torch.equal(mask_of(matcher, backend.num_words), start)


def test_the_grammar_ends_on_eos_and_rolls_back_across_its_end(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    matcher = backend.compile(StructuredOutputsParams(choice=["yes", "no"])).matcher()
    start = mask_of(matcher, backend.num_words)
    tokens = tokenizer.encode("yes")
    assert matcher.accept_tokens(tokens) and matcher.is_terminated()
    only_eos = torch.zeros(1, backend.num_words, dtype=torch.int32)
    only_eos[0, 0] = 1 << EOS
    assert torch.equal(mask_of(matcher, backend.num_words), only_eos)
    assert matcher.accept_tokens([EOS, EOS])  # after the end llguidance takes eos without counting it
    matcher.rollback(len(tokens) + 2)
    assert not matcher.is_terminated() and torch.equal(mask_of(matcher, backend.num_words), start)


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (StructuredOutputsParams(json_object=True), '{"a": [1, 2], "b": {"c": null}}', "[1]"),
        (StructuredOutputsParams(json='{"type": "array", "maxItems": 1}'), "[true]", "[1,2]"),
        (StructuredOutputsParams(regex=r"\d{3}-[a-z]+"), "123-abc", "12-abc"),
        (StructuredOutputsParams(grammar='start: "(" NUM ")"\nNUM: /[0-9]+/'), "(42)", "(x)"),
    ],
)
def test_each_kind_accepts_its_language(
    backend: LLGuidanceBackend, tokenizer: Any, spec: StructuredOutputsParams, good: str, bad: str
) -> None:
    assert backend.compile(spec).matcher().accept_tokens(tokenizer.encode(good) + [EOS])
    assert not backend.compile(spec).matcher().accept_tokens(tokenizer.encode(bad) + [EOS])


def test_choices_are_literal_strings_whatever_they_contain(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    choices = ['say "hi"', "back\\slash", "two\nlines", "café ☕", "a|b", "/x/", "%ignore"]
    grammar = backend.compile(StructuredOutputsParams(choice=choices))
    for choice in choices:
        matcher = grammar.matcher()
        assert matcher.accept_tokens(tokenizer.encode(choice)) and matcher.is_terminated(), choice
    assert not grammar.matcher().accept_tokens(tokenizer.encode("say hi"))


def test_json_is_on_one_line_unless_the_schema_asks_otherwise(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    def accepts(schema: dict[str, Any], text: str) -> bool:
        return backend.compile(StructuredOutputsParams(json=schema)).matcher().accept_tokens(tokenizer.encode(text))

    schema: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for text, ok in [('{"a":1}', True), ('{"a": 1}', True), ('{"a":  1}', False), ('{\n"a": 1}', False)]:
        assert accepts(schema, text) == ok, text
    assert accepts({**schema, "x-guidance": {"whitespace_flexible": True}}, '{\n"a":  1}')
    assert not accepts({**schema, "x-guidance": {"whitespace_flexible": False}}, '{"a": 1}')


# ---------------------------------------------------------------------- compiling


def test_the_same_spec_compiles_once(backend: LLGuidanceBackend) -> None:
    compiled: list[StructuredOutputsParams] = []

    class Counting:
        num_words = backend.num_words

        def compile(self, spec: StructuredOutputsParams) -> Any:
            compiled.append(spec)
            return backend.compile(spec)

    grammars = GrammarCompiler(Counting, capacity=2)
    ab = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    ba = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}}}
    first = grammars.compile(StructuredOutputsParams(json=ab))
    assert grammars.compile(StructuredOutputsParams(json=json.loads(json.dumps(ab)))) is first
    assert grammars.compile(StructuredOutputsParams(json=ba)) is not first  # property order is part of it
    assert len(compiled) == 2
    grammars.compile(StructuredOutputsParams(json=ab))  # now the most recently used
    grammars.compile(StructuredOutputsParams(regex="x"))  # evicts `ba`, the least recently used
    assert grammars.compile(StructuredOutputsParams(json=ab)) is first
    grammars.compile(StructuredOutputsParams(json=ba))
    assert len(compiled) == 4


def deep_chain(max_bytes: int) -> str:
    """A Lark grammar of one chain of rules (`a0: a1`, `a1: a2`, ...) as long as fits in `max_bytes`:
    llguidance builds it recursively, some 3 KB of native stack a rule."""
    lines = ["start: a0"]
    size, i = len(lines[0]), 0
    while size + 2 * len(f"a{i + 1:x}: a{i + 2:x}\n") + 8 < max_bytes:
        lines.append(f"a{i:x}: a{i + 1:x}")
        size += len(lines[-1]) + 1
        i += 1
    return "\n".join([*lines, f'a{i:x}: "z"'])


def test_a_grammar_as_deep_as_the_cap_allows_compiles_on_a_deep_stack(tokenizer: Any, backend: Any) -> None:
    """On a thread's default 8 MB stack the process would die of a segmentation fault."""
    spec = StructuredOutputsParams(grammar=deep_chain(MAX_GRAMMAR_BYTES_CEILING))
    assert len(spec_text(spec)) <= MAX_GRAMMAR_BYTES_CEILING and spec_text(spec).count("\n") > 15_000
    LLGuidanceChecker(tokenizer).check(spec)
    matcher = GrammarCompiler(lambda: backend).compile(spec).matcher()
    assert matcher.num_valid_prefix(backend.ll_tokenizer.tokenize_str("z")) == 1


class Gated:
    """A backend whose compiles wait for `release`, counting them."""

    def __init__(self, backend: LLGuidanceBackend) -> None:
        self.inner, self.num_words = backend, backend.num_words
        self.release = threading.Event()
        self.compiled: list[StructuredOutputsParams] = []

    def compile(self, spec: StructuredOutputsParams) -> Any:
        self.release.wait(10)
        self.compiled.append(spec)
        return self.inner.compile(spec)


def test_a_spec_compiles_once_on_a_compile_thread_while_the_caller_goes_on(backend: LLGuidanceBackend) -> None:
    gated = Gated(backend)
    grammars = GrammarCompiler(lambda: gated)
    spec = StructuredOutputsParams(regex="[ab]+")
    first = grammars.compile_async(spec)
    assert grammars.compile_async(StructuredOutputsParams(regex="[ab]+")) is first  # shares the compile
    assert not first.done() and grammars.cached(spec) is None  # the caller did not wait
    gated.release.set()
    grammar = first.result(10)
    assert grammars.cached(spec) is grammar and grammars.compile_async(spec).result(0) is grammar
    assert len(gated.compiled) == 1


def test_the_waitlist_hands_back_compiled_requests_in_arrival_order_and_failures_with_why() -> None:
    waitlist: GrammarWaitlist[str] = GrammarWaitlist()
    futures: list[Future[Any]] = [Future() for _ in range(4)]
    for name, future in zip("abcd", futures):
        waitlist.add(name, name, future)
    waitlist.remove("c")  # aborted while compiling
    futures[1].set_result(object())
    futures[0].set_exception(ValueError("structured_outputs.regex is invalid: x"))
    futures[2].set_result(object())
    compiled = waitlist.take_compiled()
    assert (compiled.ready, compiled.failed) == (["b"], [("a", "structured_outputs.regex is invalid: x")])
    assert len(waitlist) == 1  # d compiles on
    started = time.monotonic()
    waitlist.wait(0.05)
    assert time.monotonic() - started >= 0.04
    futures[3].set_exception(RecursionError("deep"))
    assert waitlist.take_compiled().failed == [("d", "the output constraint failed to compile: RecursionError('deep')")]


def test_the_front_end_checks_a_spec_once(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    validated: list[StructuredOutputsParams] = []
    real = LLGuidanceChecker._validate
    monkeypatch.setattr(LLGuidanceChecker, "_validate", staticmethod(lambda spec: (validated.append(spec), real(spec))))
    checker = LLGuidanceChecker(tokenizer)
    for _ in range(3):
        checker.check(StructuredOutputsParams(json={"type": "object"}))
    with pytest.raises(ValueError):
        checker.check(StructuredOutputsParams(regex="(bad"))
    with pytest.raises(ValueError):  # a refusal is not remembered as valid
        checker.check(StructuredOutputsParams(regex="(bad"))
    assert len(validated) == 3


def test_a_check_past_the_deadline_is_a_400_and_the_event_loop_never_waits() -> None:
    class Slow:  # as llguidance: the compile thread holds no GIL while it sleeps
        def check(self, spec: StructuredOutputsParams) -> None:
            time.sleep(0.5)

    async def run() -> tuple[APIError, float]:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        with pytest.raises(APIError) as info:
            await check_compiles(Slow(), StructuredOutputsParams(regex="a"), 0.1)
        ticker.cancel()
        return info.value, max(gaps)

    error, longest_gap = asyncio.run(run())
    assert (error.status, error.code) == (400, "grammar_compile_timeout")
    assert "did not compile within 0.1 s" in error.message
    assert longest_gap < 0.09  # the loop ticked on while the check ran


# Invalid specs and the words of llguidance's message for each.
INVALID_SPECS = [
    (StructuredOutputsParams(regex="(unclosed"), "unclosed group"),
    (StructuredOutputsParams(grammar="start: foo"), 'unknown name: "foo"'),
    (StructuredOutputsParams(json={"type": "string", "minLength": 5, "maxLength": 2}), "minLength (5) is greater"),
    (StructuredOutputsParams(json={"type": "objekt"}), "Invalid type: objekt"),
    (StructuredOutputsParams(json="{not json"), "line 1 column 2"),
]


@pytest.mark.parametrize(("spec", "message"), INVALID_SPECS)
def test_an_invalid_spec_raises_value_error_with_llguidances_message(
    backend: LLGuidanceBackend, spec: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs.{spec.kind} is invalid") as info:
        backend.compile(spec)
    assert message in str(info.value)


@pytest.mark.parametrize(("spec", "message"), INVALID_SPECS)
def test_the_front_end_check_gives_the_compilers_message_without_compiling(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, spec: StructuredOutputsParams, message: str
) -> None:
    def no_backend(*args: object) -> None:
        raise AssertionError("the front end built llguidance's tokenizer view")

    monkeypatch.setattr(LLGuidanceBackend, "__init__", no_backend)
    inputs = InputProcessor(tokenizer, VOCAB, [EOS], LIMITS)  # as AsyncEngine makes it: the engine compiles
    inputs.process("ok", "hello", SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"])))
    with pytest.raises(ValueError, match=f"structured_outputs.{spec.kind} is invalid") as info:
        inputs.process("bad", "hello", SamplingParams(structured_outputs=spec))
    assert message in str(info.value)


def test_input_processor_rejects_a_bad_spec_or_a_model_without_tokenizer(tokenizer: Any) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[z-a]"))
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        InputProcessor(tokenizer, VOCAB, [EOS], LIMITS).process("r", "hello", bad)
    good = SamplingParams(n=2, structured_outputs=StructuredOutputsParams(choice=["a"]))
    prepared = InputProcessor(tokenizer, VOCAB, [EOS], LIMITS, llguidance_grammars(tokenizer, VOCAB, [EOS]))
    assert len(prepared.process("r", "hello", good).children) == 2
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        InputProcessor(None, VOCAB, [EOS], LIMITS).process("r", [5, 6], good)


# ---------------------------------------------------------------------- sampling and stopping


def test_the_sampler_picks_only_allowed_tokens_and_reports_the_models_logprobs() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 50.0, 0.0, 10.0, 0.0, 0.0]] * 2)
    params = SamplingParams(temperature=1.0, top_k=1, logprobs=1, logit_bias={3: 100.0})
    meta = SamplingMetadata.build([params] * 2, [[0]] * 2, [[]] * 2, [None] * 2, [7], 8, CPU)
    bits = torch.tensor([[(1 << 1) | (1 << 5)]], dtype=torch.int32)  # row 1 may pick 1 or 5
    out = Sampler()(logits, meta, TokenBitmask(bits, torch.tensor([1])))
    assert out.sampled_token_ids.tolist() == [3, 5]
    assert out.topk_token_ids is not None and out.topk_logprobs is not None
    raw = logits[1].log_softmax(-1)
    assert out.topk_token_ids[1].tolist() == [5, 3]  # the sampled token, then the model's own top 1
    assert out.topk_logprobs[1, 0].item() == pytest.approx(raw[5].item())
    assert logits[1, 3] == 50.0  # the caller's logits are unchanged


def test_a_grammars_request_stops_on_eos_despite_ignore_eos_and_min_tokens() -> None:
    spec = StructuredOutputsParams(choice=["a"])
    params = SamplingParams(ignore_eos=True, min_tokens=5, max_tokens=10)
    free = Request("free", [1], params, frozenset({EOS}))
    constrained = Request("c", [1], dataclasses.replace(params, structured_outputs=spec), frozenset({EOS}))
    for request in (free, constrained):
        request.output_token_ids.append(EOS)
    assert free.check_stop(EOS) is None
    assert constrained.check_stop(EOS) == RequestStatus.FINISHED_STOPPED and constrained.stop_reason is None


def test_min_tokens_never_bans_eos_on_a_grammars_row() -> None:
    spec = StructuredOutputsParams(regex="a+")
    params = [SamplingParams(min_tokens=3), SamplingParams(min_tokens=3, structured_outputs=spec)]
    meta = SamplingMetadata.build(params, [[0]] * 2, [[]] * 2, [None] * 2, [EOS], 8, CPU)
    assert meta.min_tokens_rows.tolist() == [0]


def test_draft_rows_hold_the_mask_after_each_draft_and_leave_the_matcher_where_it_was(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    """Speculative decoding: row j is the mask after drafts[:j]; a refused draft ends the walk (later
    rows repeat the last mask) without breaking the matcher, which is rolled back to where it was."""
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    prefix = tokenizer.encode('{"a": 4')
    walked, reference = manager(backend), manager(backend)
    walked.add_request("r", spec, [])
    reference.add_request("r", spec, [])
    refused = tokenizer.encode("x")[0]  # not a JSON continuation here
    drafts = [prefix[0], prefix[1], refused, prefix[2]]
    mask = walked.bitmask(["r"], [drafts])
    assert mask is not None and mask.bits.shape == (5, backend.num_words) and mask.rows is None
    expected = []
    for j in range(3):  # the masks before drafts 0, 1 and 2 (the refused one)
        step = reference.bitmask(["r"])
        assert step is not None
        expected.append(step.bits.clone())
        if j < 2:
            reference.accept(["r"], [[prefix[j]]])
    assert torch.equal(mask.bits[0], expected[0][0]) and torch.equal(mask.bits[1], expected[1][0])
    assert all(torch.equal(mask.bits[j], expected[2][0]) for j in (2, 3, 4))
    again = walked.bitmask(["r"])  # rolled back: the mask before any draft, and still usable
    assert again is not None and torch.equal(again.bits[0], expected[0][0])
    walked.accept(["r"], [prefix])  # accepts without a warning: not broken
    assert walked.matchers["r"].num_valid_prefix([refused]) == 0
