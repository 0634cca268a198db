"""No field is dropped in silence: OpenAI fields the server honours or harmlessly ignores are in its schema
and served; those it cannot honour (audio, predictions, web search, image and audio inputs, the legacy
functions) are refused with a 400 naming the field; fields unknown to the API are ignored with one
warning in the log per name."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, run_server
from tokenmill.server import strict

MESSAGES = [{"role": "user", "content": "Hello"}]
CHAT: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3}


@pytest.fixture(scope="module")
def client(chat_model: Path) -> Iterator[httpx.Client]:
    with run_server(chat_model) as server, server.client() as http:
        yield http


ACCEPTED: dict[str, Any] = {
    "user": "user-1234",
    "store": False,
    "metadata": {"team": "search", "run": "7"},
    "service_tier": "auto",
    "response_format": {"type": "text"},
    "modalities": ["text"],
    "parallel_tool_calls": True,
}


def test_accepted_openai_fields_are_in_the_schema_and_served(client: httpx.Client) -> None:
    fields = client.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert ACCEPTED.keys() <= fields.keys()
    r = client.post("/v1/chat/completions", json={**CHAT, **ACCEPTED})
    assert r.status_code == 200, r.text


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "Hello"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]},
            "messages.0.content.1",
        ),
        ({"messages": [{"role": "user", "content": [AUDIO]}]}, "messages.0.content.0"),
    ],
    ids=["audio", "modalities", "prediction", "web_search", "functions", "function_call", "image", "input_audio"],
)
def test_fields_the_server_cannot_honour_are_a_400_naming_them(
    client: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_an_unknown_field_is_served_with_one_warning(client: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    strict._warned.discard("ChatCompletionRequest.frobnicate")
    with caplog.at_level(logging.WARNING, logger="tokenmill.server.strict"):
        for level in (11, 12):
            r = client.post("/v1/chat/completions", json={**CHAT, "frobnicate": {"level": level}})
            assert r.status_code == 200, r.text
    assert len([r for r in caplog.records if "'frobnicate'" in r.getMessage()]) == 1
