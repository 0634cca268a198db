"""API keys, per-key rate limits, the bounded queue, and caps on request sizes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import RunningServer, run_server
from tokenmill.server.config import ServerConfig

KEYS = ("key-a", "key-b", "key-c", "key-d")
SMALL = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def guarded(chat_model: Path) -> Iterator[RunningServer]:
    config = ServerConfig(api_keys=KEYS, requests_per_min=3, max_body_bytes=4096, max_n=2, max_prompt_tokens=64)
    with run_server(chat_model, config) as server:
        yield server


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_missing_or_wrong_key_is_401(guarded: RunningServer) -> None:
    with guarded.client() as client:
        for headers in ({}, auth("nope"), {"Authorization": "key-a"}):
            r = client.post("/v1/completions", json=SMALL, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401
        assert client.get("/version").status_code == 401


def test_health_and_ready_need_no_key_and_metrics_does(guarded: RunningServer) -> None:
    with guarded.client() as client:
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=auth("key-b")).status_code == 200


def test_a_spent_key_gets_429_with_retry_after_and_other_keys_do_not(guarded: RunningServer) -> None:
    with guarded.client() as client:
        for remaining in (2, 1, 0):
            r = client.post("/v1/completions", json=SMALL, headers=auth("key-a"))
            assert r.status_code == 200
            assert r.headers["x-ratelimit-limit-requests"] == "3"
            assert r.headers["x-ratelimit-remaining-requests"] == str(remaining)
        r = client.post("/v1/completions", json=SMALL, headers=auth("key-a"))
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["Retry-After"]) >= 1
        assert client.post("/v1/completions", json=SMALL, headers=auth("key-b")).status_code == 200


def test_caps_on_n_prompt_and_body_size(guarded: RunningServer) -> None:
    with guarded.client(headers=auth("key-c")) as client:
        r = client.post("/v1/completions", json={**SMALL, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = client.post("/v1/completions", json={**SMALL, "prompt": list(range(3, 80))})
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
        r = client.post("/v1/completions", json={**SMALL, "prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        assert client.post("/v1/completions", content=chunked()).status_code == 413


def test_bad_bodies_are_400(guarded: RunningServer) -> None:
    with guarded.client(headers=auth("key-d")) as client:
        for content in (b"{not json", b"[1, 2]", b'{"prompt": "x", "max_tokens": "3"}'):
            r = client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 400
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert client.get("/v1/completions").status_code == 405


def test_tokens_per_minute_limit(chat_model: Path) -> None:
    config = ServerConfig(api_keys=("k",), tokens_per_min=100)
    with run_server(chat_model, config) as server, server.client(headers=auth("k")) as client:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 40, "ignore_eos": True}  # 44 tokens each
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 200
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 429 and "Retry-After" in r.headers
        assert int(r.headers["x-ratelimit-remaining-tokens"]) < 44
        too_big = client.post("/v1/completions", json={**body, "max_tokens": 120})
        assert too_big.status_code == 400


def test_a_full_queue_answers_429_at_once(chat_model: Path) -> None:
    config = ServerConfig(max_waiting_requests=2)
    with run_server(chat_model, config, max_num_seqs=1) as server:
        # Hold the engine inside its first step, so that admitted requests stay queued.
        gate = threading.Event()
        runner = server.core.runner
        real_forward = runner._forward  # every step's forward: eager, fused decode stack or CUDA graph

        def gated_forward(*args: Any, **kwargs: Any) -> Any:
            gate.wait(20)
            return real_forward(*args, **kwargs)

        runner._forward = gated_forward  # type: ignore[method-assign]
        body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}

        async def one(client: httpx.AsyncClient) -> tuple[int, str | None, bool]:
            r = await client.post("/v1/completions", json=body)
            return r.status_code, r.headers.get("Retry-After"), gate.is_set()

        async def main() -> list[tuple[int, str | None, bool]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                tasks = [asyncio.ensure_future(one(client)) for _ in range(6)]
                deadline = time.monotonic() + 20
                while sum(t.done() for t in tasks) < 4 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                gate.set()
                return await asyncio.gather(*tasks)

        results = asyncio.run(main())
        assert sorted(s for s, _, _ in results) == [200, 200, 429, 429, 429, 429]
        for status, retry_after, released in results:
            if status == 429:
                assert retry_after == "1"
                assert not released  # answered while the engine was still stuck: no queueing
        server.wait_idle()
