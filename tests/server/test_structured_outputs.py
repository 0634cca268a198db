"""Constrained outputs through the official openai client on the tiny random model: whatever it would
have written, response_format json_schema gives JSON that parses and follows the schema; json_object,
choice and regex hold too, by their OpenAI names, vLLM's structured_outputs and the older guided_* names.
The 20-schema run on the embedded SmolLM2: tests/e2e/test_structured_default_model.py."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import llguidance
import openai
import pydantic
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, run_server


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[RunningServer]:
    with run_server(chat_model, max_model_len=512) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


MESSAGES: list[Any] = [{"role": "user", "content": "Answer in JSON."}]


def obj(properties: dict[str, Any]) -> dict[str, Any]:
    """An object that must have every property, and no other."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# Bounded schemas: whatever the random model prefers, each output ends within max_tokens.
SCHEMAS = {
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "max_length": obj({"name": {"type": "string", "maxLength": 8}}),
    "max_items": obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    "nested": obj(
        {"user": obj({"id": {"type": "integer", "minimum": 0, "maximum": 999}, "admin": {"type": "boolean"}})}
    ),
    "integer_bounds": obj({"score": {"type": "integer", "minimum": -5, "maximum": 5}}),
    "number_bounds": obj({"ratio": {"type": "number", "minimum": 0, "maximum": 10}}),
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "array_root": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 9},
        "minItems": 1,
        "maxItems": 4,
    },
    "any_of": {"anyOf": [obj({"kind": {"const": "a"}}), {"type": "boolean"}]},
}


def finished_json(choice: Any) -> Any:
    assert choice.finish_reason == "stop", choice
    return json.loads(choice.message.content)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(client: openai.OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        n=3,
        max_tokens=200,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    )
    for choice in out.choices:
        jsonschema.validate(finished_json(choice), schema)


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=30)
    name: str = pydantic.Field(max_length=10)


def test_the_sdks_parse_helper_fills_a_pydantic_model(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=200, seed=8, response_format=Pet
    ).choices[0]
    assert out.finish_reason == "stop" and isinstance(out.message.parsed, Pet)


def test_json_object_outputs_parse_as_objects(server: RunningServer, client: openai.OpenAI) -> None:
    # Any object has no bound: the random model would fill a string until max_tokens. Favouring '"' and
    # '}' ends strings and the object soon; the constraint still decides where each may go.
    favoured = {str(server.engine.tokenizer.convert_tokens_to_ids(t)): 20 for t in ('"', "}")}
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        n=2,
        max_tokens=200,
        seed=2,
        logit_bias=favoured,
        response_format={"type": "json_object"},
    )
    for choice in out.choices:
        assert isinstance(finished_json(choice), dict)


def test_streamed_json_schema_output_parses(client: openai.OpenAI) -> None:
    schema = SCHEMAS["nested"]
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=200,
            seed=3,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "nested", "schema": schema}},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)


CHOICES = ["positive", "negative", "neutral"]


@pytest.mark.parametrize(
    "extra", [{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}], ids=["new", "old"]
)
def test_choice_returns_one_of_the_choices(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=4, max_tokens=20, seed=4, extra_body=extra
    )
    assert all(c.message.content in CHOICES and c.finish_reason == "stop" for c in out.choices)


PHONE = r"\+[0-9]{2} [0-9]{3}-[0-9]{4}"


@pytest.mark.parametrize(
    "extra", [{"structured_outputs": {"regex": PHONE}}, {"guided_regex": PHONE}], ids=["new", "old"]
)
def test_regex_output_matches(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=3, max_tokens=40, seed=5, extra_body=extra
    )
    assert all(re.fullmatch(PHONE, c.message.content or "") for c in out.choices), [c.message for c in out.choices]


def test_guided_json_is_the_old_name_of_a_schema(client: openai.OpenAI) -> None:
    schema = SCHEMAS["enum"]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=100, seed=6, extra_body={"guided_json": schema}
    )
    jsonschema.validate(finished_json(out.choices[0]), schema)


def test_completions_take_structured_outputs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=["The answer:", "Hello"],
        max_tokens=40,
        seed=7,
        extra_body={"structured_outputs": {"regex": PHONE}},
    )
    assert len(out.choices) == 2 and all(re.fullmatch(PHONE, c.text) for c in out.choices)


def test_an_output_cut_by_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    schema = obj({"name": {"type": "string", "minLength": 50}})
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "long", "schema": schema}},
    ).choices[0]
    assert out.finish_reason == "length"
    assert (out.message.content or "").lstrip().startswith("{")  # a start of the JSON, which does not parse


# ---------------------------------------------------------------------- refused: 400, and the server goes on


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ],
)
def test_two_constraints_are_a_400(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        {"structured_outputs": {"json": "{not json"}},
        {"structured_outputs": {"regex": "a(b"}},  # unbalanced
        {"guided_grammar": "start: undefined_rule"},
    ],
    ids=["schema", "schema_text", "regex", "grammar"],
)
def test_a_constraint_that_does_not_compile_is_a_400_and_the_server_goes_on(
    client: openai.OpenAI, extra: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "invalid_request_error"
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_constraint_over_the_servers_caps_is_a_400_naming_its_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=3, extra_body={"guided_choice": ["a"] * 1001}
        )
    assert isinstance(info.value.body, dict)
    assert (info.value.body["param"], info.value.body["code"]) == ("guided_choice", "grammar_too_large")


SLOW_S = 2.0  # how long the slow grammar takes to build, at the front end's check and in the engine


def slow_llguidance(marker: str) -> type:
    """llguidance's LLMatcher, but a grammar holding `marker` takes SLOW_S to validate and to compile
    (sleeping holds no GIL, as llguidance's own compiles)."""
    real = llguidance.LLMatcher

    def slowly(grammar: str) -> None:
        if marker in grammar:
            time.sleep(SLOW_S)

    class SlowMatcher:
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)
        grammar_from_regex = staticmethod(real.grammar_from_regex)
        grammar_from_lark = staticmethod(real.grammar_from_lark)

        def __new__(cls, tokenizer: Any, grammar: str, **kwargs: Any) -> Any:
            slowly(grammar)
            return real(tokenizer, grammar, **kwargs)

        @staticmethod
        def validate_grammar(grammar: str, *args: Any, **kwargs: Any) -> str:
            slowly(grammar)
            return real.validate_grammar(grammar, *args, **kwargs)

    return SlowMatcher


def test_a_slow_grammar_stalls_no_other_requests_templating_or_stream(
    client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = f"slow{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(llguidance, "LLMatcher", slow_llguidance(marker))
    slow: dict[str, Any] = {}

    def ask_slow() -> None:
        started = time.monotonic()
        extra = {"guided_regex": f"{marker}[0-9]"}
        out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, extra_body=extra)
        slow.update(seconds=time.monotonic() - started, text=out.choices[0].message.content)

    thread = threading.Thread(target=ask_slow)
    thread.start()
    latencies = []  # other requests, one after another while the slow one compiles: templated, streamed
    while thread.is_alive():
        started = time.monotonic()
        for _ in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, stream=True):
            pass
        latencies.append(time.monotonic() - started)
    thread.join()
    assert re.fullmatch(f"{marker}[0-9]", slow["text"]) and slow["seconds"] >= SLOW_S
    assert len(latencies) >= 4 and max(latencies) < SLOW_S / 2, latencies


def test_the_schema_states_the_new_fields(server: RunningServer) -> None:
    with server.client() as http:
        schemas = http.get("/openapi.json").json()["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice"} <= chat.keys()
    assert {"structured_outputs", "guided_json", "guided_grammar"} <= completion.keys()
