"""The server prepares requests through the engine's one preparation: max_tokens and the prompt's
length are resolved by request_limits.resolve_max_tokens, under the server's caps, once per prompt."""

from __future__ import annotations

import pytest

from tests.server.conftest import RunningServer
from tokenmill.engine import input_processor
from tokenmill.engine.request_limits import RequestCaps, resolve_max_tokens
from tokenmill.scheduling.scheduler import AdmissionLimits


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int | None, RequestCaps]]:
    seen: list[tuple[int, int | None, RequestCaps]] = []

    def counting(limits: AdmissionLimits, num_prompt_tokens: int, requested: int | None, caps: RequestCaps) -> int:
        seen.append((num_prompt_tokens, requested, caps))
        return resolve_max_tokens(limits, num_prompt_tokens, requested, caps)

    monkeypatch.setattr(input_processor, "resolve_max_tokens", counting)
    return seen


def test_a_chat_request_resolves_max_tokens_once(
    server: RunningServer, calls: list[tuple[int, int | None, RequestCaps]]
) -> None:
    with server.client() as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200
    state = server.state
    assert calls == [(r.json()["usage"]["prompt_tokens"], 2, RequestCaps(state.max_tokens, state.max_prompt_tokens))]


def test_completions_resolve_each_prompts_max_tokens_once_with_openais_default(
    server: RunningServer, calls: list[tuple[int, int | None, RequestCaps]]
) -> None:
    with server.client() as client:
        r = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]]})
    assert r.status_code == 200
    assert [(n, requested, caps.default_max_tokens) for n, requested, caps in calls] == [(3, None, 16), (2, None, 16)]


def test_max_tokens_over_the_servers_cap_is_the_functions_400(
    server: RunningServer, calls: list[tuple[int, int | None, RequestCaps]]
) -> None:
    cap = server.state.max_tokens
    with server.client() as client:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": cap + 1}
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("max_tokens_too_large", "max_tokens")
    assert error["message"] == f"max_tokens is {cap + 1}; this server allows at most {cap}."
    assert len(calls) == 1
