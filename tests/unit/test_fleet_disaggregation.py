"""The fleet's prefill hop, without Ray: which requests take it and the body sent to the prefill replica."""

from __future__ import annotations

import json

import pytest

from tokenmill.fleet.disaggregation import prefill_body, takes_prefill_hop
from tokenmill.fleet.routing import hints_from_body


def test_the_prefill_body_asks_for_one_unstreamed_token_of_the_same_prompt() -> None:
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "cache_salt": "s",
        "max_completion_tokens": 300,
        "min_tokens": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "logprobs": True,
        "top_logprobs": 5,
        "temperature": 0.7,
    }
    body = prefill_body("/v1/chat/completions", json.dumps(request).encode())
    assert body is not None
    # What decides the prompt's tokens and block hashes stays; what would cost more than the prompt goes.
    assert json.loads(body) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "cache_salt": "s",
        "temperature": 0.7,
        "max_tokens": 1,
        "stream": False,
    }


def test_a_completion_drops_echo_and_logprobs() -> None:
    body = prefill_body("/v1/completions", b'{"prompt": "abc", "echo": true, "logprobs": 2, "max_tokens": 50}')
    assert body is not None and json.loads(body) == {"prompt": "abc", "max_tokens": 1, "stream": False}


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/embeddings", b'{"input": "abc"}'),
        ("/v1/completions", b"not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", b"[" * 100_000),
    ],
)
def test_other_routes_and_bodies_take_no_hop(path: str, body: bytes) -> None:
    assert prefill_body(path, body) is None


def test_only_long_enough_prompts_take_the_hop() -> None:
    hints = hints_from_body("/v1/completions", json.dumps({"prompt": "x" * 400}).encode())
    assert hints is not None and hints.prompt_tokens == 100
    assert takes_prefill_hop("/v1/completions", hints.prompt_tokens, 100)
    assert not takes_prefill_hop("/v1/completions", hints.prompt_tokens, 101)
    assert not takes_prefill_hop("/v1/responses", 10_000, 100)
