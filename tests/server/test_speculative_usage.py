"""`usage.speculative_decoding` ({"num_draft_tokens", "num_accepted_tokens"}) in chat and completions
responses, streamed (the final usage chunk) or not, from a server started with a speculative config;
left out entirely by a server without one, so its responses keep OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, run_server

# Lookups of a single token: the tiny random model's greedy output repeats single tokens (rarely pairs),
# so drafts are proposed (and mostly rejected) within a few dozen tokens.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
REPEATING = "red green blue, " * 12
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": REPEATING}], "max_tokens": 48, "temperature": 0}
COMPLETION = {"model": MODEL_NAME, "prompt": REPEATING, "max_tokens": 48, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def spec_server(chat_model: Path) -> Iterator[RunningServer]:
    """As `tokenmill serve --speculative-config '<NGRAM>'` runs: the engine core in a process of its own
    (the counts cross the pipe)."""
    with run_server(chat_model, engine_process=True, speculative_config=NGRAM) as running:
        yield running


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with server.client() as client:
        response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    return usage


def _streamed_usage(server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The usage of the stream's last chunk (stream_options.include_usage)."""
    events = []
    with (
        server.client() as client,
        client.stream(
            "POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ) as response,
    ):
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == []
    usage: dict[str, Any] = last["usage"]
    return usage


def _usage(server: RunningServer, path: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    return _streamed_usage(server, path, body) if stream else _post(server, path, body)


ENDPOINTS = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
IDS = ["chat", "completions"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("path", "body"), ENDPOINTS, ids=IDS)
def test_a_speculating_server_reports_draft_and_accepted_tokens(
    spec_server: RunningServer, path: str, body: dict[str, Any], stream: bool
) -> None:
    spec = _usage(spec_server, path, body, stream)["speculative_decoding"]
    assert set(spec) == {"num_draft_tokens", "num_accepted_tokens"}
    drafted, accepted = spec["num_draft_tokens"], spec["num_accepted_tokens"]
    assert isinstance(drafted, int) and isinstance(accepted, int)
    assert 0 <= accepted <= drafted


def test_drafts_are_counted(spec_server: RunningServer) -> None:
    spec = _post(spec_server, "/v1/completions", COMPLETION)["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0


def test_the_counts_add_up_over_the_samples_of_a_request(spec_server: RunningServer) -> None:
    one = _post(spec_server, "/v1/completions", COMPLETION)["speculative_decoding"]
    two = _post(spec_server, "/v1/completions", {**COMPLETION, "n": 2})["speculative_decoding"]
    # Greedy: both samples are the first one again, drafts and all.
    assert two == {k: 2 * v for k, v in one.items()}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("path", "body"), ENDPOINTS, ids=IDS)
def test_a_server_without_speculation_leaves_the_field_out(
    server: RunningServer, path: str, body: dict[str, Any], stream: bool
) -> None:
    usage = _usage(server, path, body, stream)
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


def test_the_schema_documents_the_field(server: RunningServer) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert "speculative_decoding" in schema["UsageInfo"]["properties"]
    assert set(schema["SpeculativeDecodingUsage"]["properties"]) == {"num_draft_tokens", "num_accepted_tokens"}
