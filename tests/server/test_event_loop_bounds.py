"""One request cannot stall everyone: prompts that could never fit are refused by their length before
any tokenization or templating, the tokenizer runs off the event loop, and refused requests spend
their key's request budget."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, run_server
from tokenmill.server.config import ServerConfig, ServerState
from tokenmill.server.errors import APIError
from tokenmill.server.prompts import MAX_CHARS_PER_TOKEN, check_messages_size, check_prompt_size
from tokenmill.server.security import RateLimiter

REQUESTS_PER_MIN = 10
KEYS = ("stream", "slow", "bounds", "flood", "other")
HUGE = "The quick brown fox jumps over the lazy dog. " * 86_000  # ~3.9 MB, under the 4 MiB body cap
CHAT = {"model": MODEL_NAME, "max_tokens": 2}


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[RunningServer]:
    config = ServerConfig(api_keys=KEYS, requests_per_min=REQUESTS_PER_MIN)
    with run_server(chat_model, config) as running:  # max_model_len 256: 255 prompt tokens at most
        # One generation first: the kernels load (or build) before any test times a stream.
        with httpx.Client(base_url=running.url, headers=auth("other"), timeout=600) as client:
            body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
        yield running


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, delay_s: float = 0.0) -> list[float]:
    """Wrap owner.name to record when it is called (and to take `delay_s` first, releasing the GIL as
    a Rust tokenizer does); the returned list fills as it is called."""
    real: Callable[..., Any] = getattr(owner, name)
    calls: list[float] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        time.sleep(delay_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def test_a_huge_prompt_is_refused_while_a_stream_keeps_its_pace(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = server.core.runner
    real_forward = runner._forward

    def paced_forward(*args: Any, **kwargs: Any) -> Any:  # 25 ms a step: the stream outlasts the refusals
        time.sleep(0.025)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(runner, "_forward", paced_forward)
    refusals: list[httpx.Response] = []
    refused_by: list[float] = []

    def send_huge() -> None:
        with server.client(headers=auth("stream")) as client:
            for _ in range(3):
                refusals.append(client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": HUGE}))
        refused_by.append(time.monotonic())

    sender = threading.Thread(target=send_huge)
    stream = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 64, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    with server.client(headers=auth("stream")) as client, client.stream("POST", "/v1/completions", json=stream) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 1:
                    sender.start()
    sender.join()
    gap = max(b - a for a, b in zip(arrivals, arrivals[1:]))
    assert gap < 1.0, f"a token waited {gap:.2f} s"
    assert len(arrivals) > 32  # chunks (one may carry several tokens) all through the refusals
    assert refused_by[0] < arrivals[-1], "the stream ended before the huge prompts were all refused"
    for refused in refusals:
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "prompt_too_long"
        assert refused.json()["error"]["param"] == "prompt"
    server.wait_idle()


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_tokenizing_and_templating_run_off_the_event_loop(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    if route == "completions":
        entered = _calls(monkeypatch, server.engine.inputs, "tokenize", delay_s=1.0)
        path, body = "/v1/completions", {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    else:
        entered = _calls(monkeypatch, server.engine.tokenizer, "apply_chat_template", delay_s=1.0)
        path, body = "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Hello"}]}
    statuses: list[int] = []

    def send_slow() -> None:
        with server.client(headers=auth("slow")) as client:
            statuses.append(client.post(path, json=body).status_code)

    sender = threading.Thread(target=send_slow)
    sender.start()
    deadline = time.monotonic() + 10
    while not entered:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with server.client() as client:  # the loop answers while the slow tokenization runs
        start = time.monotonic()
        assert client.get("/health").status_code == 200
        waited = time.monotonic() - start
    sender.join()
    assert statuses == [200]
    assert waited < 0.5, f"/health waited {waited:.2f} s for the tokenizer"
    server.wait_idle()


def test_a_chat_too_long_to_fit_is_refused_before_templating(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    templated = _calls(monkeypatch, server.engine.tokenizer, "apply_chat_template")
    cap = server.state.max_prompt_tokens
    assert cap == 255
    too_many = [{"role": "user", "content": "hi"}] * (cap + 1)  # each message takes at least one token
    too_much = [{"role": "user", "content": "x" * (cap * MAX_CHARS_PER_TOKEN + 1)}]
    with server.client(headers=auth("bounds")) as client:
        for messages in (too_many, too_much):
            r = client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "prompt_too_long"
            assert r.json()["error"]["param"] == "messages"
        assert templated == []
        r = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and len(templated) == 1
    server.wait_idle()


def test_a_completion_prompt_too_long_to_fit_is_refused_before_tokenizing(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenized = _calls(monkeypatch, server.engine.inputs, "tokenize")
    cap = server.state.max_prompt_tokens
    with server.client(headers=auth("bounds")) as client:
        for prompt in ("x" * (cap * MAX_CHARS_PER_TOKEN + 1), [5] * (cap + 1), ["Hello", "x" * 20_000]):
            r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "prompt_too_long"
        assert tokenized == []


def test_refused_requests_spend_the_keys_request_budget(server: RunningServer) -> None:
    good = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    bad = {**good, "prompt": "x" * 20_000}  # too long to fit: 400
    with server.client(headers=auth("flood")) as client:
        statuses = [client.post("/v1/completions", json=bad).status_code for _ in range(REQUESTS_PER_MIN)]
        assert statuses == [400] * REQUESTS_PER_MIN
        r = client.post("/v1/completions", json=good)  # the budget is spent, on refusals
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert client.post("/v1/completions", json=bad).status_code == 429
    with server.client(headers=auth("other")) as client:
        assert client.post("/v1/completions", json=good).status_code == 200
    server.wait_idle()


# ---------------------------------------------------------------------- the pieces, without a server


def _state(max_prompt_tokens: int) -> ServerState:
    return cast(ServerState, SimpleNamespace(max_prompt_tokens=max_prompt_tokens))


def test_the_length_bounds_scale_with_the_prompt_token_cap() -> None:
    state, limit = _state(10), 10 * MAX_CHARS_PER_TOKEN
    check_prompt_size(state, "x" * limit)
    check_prompt_size(state, list(range(10)))
    check_messages_size(state, [{"role": "user", "content": "x" * (limit // 10)}] * 10)
    for too_long in ("x" * (limit + 1), list(range(11))):
        with pytest.raises(APIError) as err:
            check_prompt_size(state, too_long)
        assert (err.value.status, err.value.code, err.value.param) == (400, "prompt_too_long", "prompt")
    for messages in ([{"role": "user", "content": ""}] * 11, [{"role": "user", "content": "x" * (limit + 1)}]):
        with pytest.raises(APIError) as err:
            check_messages_size(state, messages)
        assert (err.value.status, err.value.code, err.value.param) == (400, "prompt_too_long", "messages")


def test_an_admitted_request_is_charged_once_and_a_refused_one_once() -> None:
    limiter = RateLimiter(requests_per_min=3)
    with limiter.charging_refusals("k"):
        admission = limiter.acquire("k", 0)
    assert admission.headers["x-ratelimit-remaining-requests"] == "2"
    with pytest.raises(APIError), limiter.charging_refusals("k"):
        raise APIError(400, "bad", "invalid_request")
    for status in (404, 429, 503):  # not the client's mistake, or already a refusal by the limits
        with pytest.raises(APIError), limiter.charging_refusals("k"):
            raise APIError(status, "no")
    assert limiter.acquire("k", 0).headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(APIError) as err, limiter.charging_refusals("k"):
        pass
    assert err.value.status == 429
