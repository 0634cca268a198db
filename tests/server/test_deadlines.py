"""Deadlines (--request-timeout, --max-queue-time, and a request's own `request_timeout` and
`max_queue_time`): a request past one is aborted, its KV blocks come back, and its client gets a 504
(type "timeout"), or, streamed, a last chunk with finish_reason "abort" and then an error event.

The engine is held inside a step (a gate on the model runner's forward) so that no request can finish
by itself; margins are seconds wide."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import RunningServer, run_server
from tokenmill.server.config import ServerConfig

SERVER_TIMEOUT = 4.0
LONG = {"prompt": "Hello world", "max_tokens": 100, "ignore_eos": True}


@pytest.fixture(scope="module")
def timed(chat_model: Path) -> Iterator[RunningServer]:
    with run_server(chat_model, ServerConfig(request_timeout_s=SERVER_TIMEOUT)) as server:
        yield server


@contextmanager
def held_engine(server: RunningServer, after: int = 0) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold the engine inside its step from its `after`+1-th forward on, until the block exits or the
    gate is set. Yields (entered: set once the engine is held, gate)."""
    entered, gate = threading.Event(), threading.Event()
    runner = server.core.runner
    real_forward = runner._forward
    calls = 0

    def gated_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > after:
            entered.set()
            gate.wait(60)
        return real_forward(*args, **kwargs)

    runner._forward = gated_forward  # type: ignore[method-assign]
    try:
        yield entered, gate
    finally:
        gate.set()
        runner._forward = real_forward  # type: ignore[method-assign]


def _all_blocks_free(server: RunningServer) -> None:
    server.wait_idle(20)  # raises unless nothing is in flight and every block is free
    assert server.free_blocks() == server.engine.num_blocks


def _timeout_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 504, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "timeout"
    return error


def test_a_request_past_the_server_request_timeout_gets_504_and_its_blocks_back(timed: RunningServer) -> None:
    with held_engine(timed), timed.client() as client:
        started = time.monotonic()
        response = client.post("/v1/completions", json=LONG)
        elapsed = time.monotonic() - started
    assert _timeout_error(response)["code"] == "request_timeout"
    assert SERVER_TIMEOUT - 0.5 <= elapsed < SERVER_TIMEOUT + 10
    _all_blocks_free(timed)
    with timed.client() as client:  # still serving
        ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_stream_past_its_deadline_ends_with_abort_then_an_error_event(timed: RunningServer) -> None:
    events: list[Any] = []
    with held_engine(timed, after=2), timed.client() as client:  # a few tokens come first
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "timeout" and error["code"] == "request_timeout"
    chunks = events[:-2]
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    _all_blocks_free(timed)


def test_a_request_timeout_below_the_servers_applies(timed: RunningServer) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100, "request_timeout": 1}
    with held_engine(timed), timed.client() as client:
        started = time.monotonic()
        response = client.post("/v1/chat/completions", json=body)
        elapsed = time.monotonic() - started
    _timeout_error(response)
    assert 0.5 <= elapsed < SERVER_TIMEOUT - 0.5
    _all_blocks_free(timed)


def test_a_request_timeout_above_the_servers_is_clamped_to_it(timed: RunningServer) -> None:
    with held_engine(timed), timed.client() as client:
        started = time.monotonic()
        response = client.post("/v1/completions", json={**LONG, "request_timeout": 1000.0})
        elapsed = time.monotonic() - started
    _timeout_error(response)
    assert elapsed < SERVER_TIMEOUT + 10
    _all_blocks_free(timed)


def test_deadline_fields_are_validated(timed: RunningServer) -> None:
    with timed.client() as client:
        for bad in ({"request_timeout": 0}, {"max_queue_time": -1}, {"request_timeout": "5"}):
            response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **bad})
            assert response.status_code == 400, (bad, response.text)


def test_a_request_queued_past_max_queue_time_ends_while_one_running_completes(chat_model: Path) -> None:
    config = ServerConfig(max_queue_time_s=2.0)
    with run_server(chat_model, config, max_num_seqs=1) as server:
        with held_engine(server, after=3) as (entered, gate):  # the running request has its first tokens

            async def main() -> tuple[list[Any], httpx.Response]:
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

                    async def running() -> list[Any]:
                        body = {**LONG, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
                        async with client.stream("POST", "/v1/completions", json=body) as response:
                            assert response.status_code == 200
                            return [json.loads(x[6:]) async for x in response.aiter_lines() if x.startswith("data: {")]

                    first = asyncio.ensure_future(running())
                    while not entered.is_set():
                        await asyncio.sleep(0.01)
                    started = time.monotonic()
                    queued = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
                    assert time.monotonic() - started >= 1.5
                    gate.set()  # the engine goes on: the running request, past its queue time, completes
                    return await first, queued

            chunks, queued = asyncio.run(main())
        assert _timeout_error(queued)["code"] == "queue_timeout"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"  # within its deadlines: complete
        assert chunks[-1]["usage"]["completion_tokens"] == 40 and all("error" not in c for c in chunks)
        _all_blocks_free(server)
        with server.client() as client:  # a request within its deadline completes
            ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200, ok.text
