"""Constrained decoding offline on a tiny random llama with a small trained tokenizer: whatever the random
model prefers, the output is in the language asked for (a JSON schema, a regex, a choice, a Lark grammar),
ends on eos, and stays so with n > 1, preemption and recompute, and beside unconstrained requests."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.tiny_models import make_tiny_model, make_tiny_tokenizer
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.outputs import RequestOutput

PROMPTS = ["Answer in JSON:", "The capital of France is", "hello"]


def obj(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# Bounded, so that every output ends well within max_tokens whatever the model prefers.
SCHEMA = obj(
    {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    }
)
# At most 29 characters: fits the small KV cache of the preemption test.
SHORT_SCHEMA = obj({"color": SCHEMA["properties"]["color"], "age": SCHEMA["properties"]["age"]})
EMAIL = r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)"
GREETING = 'start: ("hi" | "hello") " " NAME\nNAME: /[a-z]{1,6}/'


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("structured"), "llama")
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(str(model), dtype="float32", num_kv_blocks=256, max_model_len=512)


def constrained(max_tokens: int = 200, **kwargs: Any) -> SamplingParams:
    spec = kwargs.pop("spec")
    return SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **kwargs)


def texts(outputs: list[RequestOutput]) -> list[str]:
    for out in outputs:
        for choice in out.outputs:
            assert choice.finish_reason == "stop" and choice.stop_reason is None, choice
    return [choice.text for out in outputs for choice in out.outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_parse_and_validate(llm: LLM, temperature: float) -> None:
    params = constrained(spec=StructuredOutputsParams(json=SCHEMA), temperature=temperature, seed=0)
    for text in texts(llm.generate(PROMPTS, params, use_tqdm=False)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_grammar_outputs_are_in_their_language(llm: LLM) -> None:
    cases = [
        (StructuredOutputsParams(regex=EMAIL), EMAIL),
        (StructuredOutputsParams(choice=["red", "green", 'say "blue"']), 'red|green|say "blue"'),
        (StructuredOutputsParams(grammar=GREETING), "(hi|hello) [a-z]{1,6}"),
    ]
    for spec, pattern in cases:
        for text in texts(llm.generate(PROMPTS, constrained(spec=spec, temperature=1.0, seed=1), use_tqdm=False)):
            assert re.fullmatch(pattern, text), (spec.kind, text)


def test_every_sample_of_n_follows_the_schema_and_ignore_eos_still_stops(llm: LLM) -> None:
    params = constrained(spec=StructuredOutputsParams(json=SCHEMA), n=2, temperature=1.0, seed=5, ignore_eos=True)
    [out] = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert len(out.outputs) == 2
    for text in texts([out]):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_preempted_requests_recompute_into_the_same_valid_outputs(model: Path, llm: LLM) -> None:
    """24 blocks of 4 tokens cannot hold 8 growing outputs at once: requests are preempted, recomputed,
    and their new matchers take the tokens they had output."""
    params = [
        constrained(spec=StructuredOutputsParams(json=SHORT_SCHEMA), max_tokens=64, temperature=temperature, seed=i)
        for i, temperature in enumerate([0.0, 1.0] * 4)
    ]
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 3)][:8]
    expected = texts(llm.generate(prompts, params, use_tqdm=False))
    small = LLM(str(model), dtype="float32", num_kv_blocks=24, block_size=4, max_model_len=96)
    got = texts(small.generate(prompts, params, use_tqdm=False))
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert got == expected  # greedy rows, and seeded ones (reseeded from seed and position)
    for text in got:
        jsonschema.validate(json.loads(text), SHORT_SCHEMA)


def test_an_unconstrained_request_beside_a_constrained_one_keeps_its_tokens(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    alone = llm.generate(PROMPTS[1:2], free, use_tqdm=False)[0].outputs[0]
    json_params = constrained(spec=StructuredOutputsParams(json=SCHEMA), temperature=0.0, logprobs=2)
    together = llm.generate([PROMPTS[0], PROMPTS[1]], [json_params, free], use_tqdm=False)
    assert together[1].outputs[0].token_ids == alone.token_ids
    out = together[0].outputs[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert all(token in entry for token, entry in zip(out.token_ids, out.logprobs))


def test_stop_strings_and_max_tokens_end_a_constrained_request(llm: LLM) -> None:
    spec = StructuredOutputsParams(regex="[a-z]{5}-[a-z]{5}")
    [stopped] = llm.generate(PROMPTS[:1], constrained(spec=spec, stop=["-"], temperature=0.0), use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop" and re.fullmatch("[a-z]{5}", stopped.outputs[0].text)
    [cut] = llm.generate(PROMPTS[:1], constrained(spec=spec, max_tokens=2, temperature=0.0), use_tqdm=False)
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 2
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # the runner drops ended requests
    assert llm.engine.runner.structured.matchers == {}


def test_a_bad_spec_fails_before_anything_is_queued(llm: LLM) -> None:
    good = constrained(spec=StructuredOutputsParams(regex="a"))
    bad = constrained(spec=StructuredOutputsParams(regex="(a"))
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        llm.generate(PROMPTS[:2], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()
