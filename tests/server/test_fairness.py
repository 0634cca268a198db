"""Fairness between clients: the waiting-queue bound holds for a request arriving at an empty queue,
`priority` counts only for --priority-keys, failed logins are throttled per address (X-Forwarded-For
only from --forwarded-allow-ips), and /metrics
needs a key once keys are set (unless --metrics-public)."""

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
from tokenmill.server.security import LoginThrottle

SMALL = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "ignore_eos": True}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(chat_model: Path) -> Iterator[RunningServer]:
    config = ServerConfig(api_keys=("plain", "vip"), priority_keys=("vip",), max_waiting_requests=4)
    with run_server(chat_model, config, max_num_seqs=1, scheduling_policy="priority") as server:
        yield server


def test_one_request_above_the_queue_bound_is_refused_while_a_small_one_is_served(keyed: RunningServer) -> None:
    with keyed.client(headers=auth("plain")) as client:
        big = client.post("/v1/completions", json={**SMALL, "prompt": ["a", "b", "c"], "n": 2})  # 6 > 4
        assert big.status_code == 400
        assert big.json()["error"]["code"] == "request_exceeds_queue_limit"
        assert client.post("/v1/completions", json=SMALL).status_code == 200
    keyed.wait_idle()


def _served_order(server: RunningServer, key: str) -> list[str]:
    """With the engine held in the step of a first request, queue "early" (priority 0) then "urgent"
    (priority -5) from `key`, release the engine, and return the two in the order they finished."""
    entered, gate = threading.Event(), threading.Event()
    runner = server.core.runner
    real_forward = runner._forward

    def gated_forward(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(20)
        return real_forward(*args, **kwargs)

    runner._forward = gated_forward  # type: ignore[method-assign]
    finished: list[str] = []

    async def one(client: httpx.AsyncClient, name: str, priority: int) -> None:
        # 24 tokens each: the second finishes many steps after the first, so the responses cannot
        # overtake each other on the way back (with 2 tokens a fast machine let them race).
        r = await client.post("/v1/completions", json={**SMALL, "max_tokens": 24, "priority": priority})
        assert r.status_code == 200, r.text
        finished.append(name)

    async def until(condition: Any) -> None:
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=auth(key)) as client:
            first = asyncio.ensure_future(one(client, "first", 0))
            await until(entered.is_set)  # "first" holds the only running slot
            early = asyncio.ensure_future(one(client, "early", 0))
            await until(lambda: server.engine.waiting_load()[0] >= 1)
            urgent = asyncio.ensure_future(one(client, "urgent", -5))
            await until(lambda: server.engine.waiting_load()[0] >= 2)
            gate.set()
            await asyncio.gather(first, early, urgent)

    try:
        asyncio.run(main())
    finally:
        gate.set()
        runner._forward = real_forward  # type: ignore[method-assign]
    server.wait_idle()
    return [name for name in finished if name != "first"]


@pytest.mark.parametrize(("key", "order"), [("plain", ["early", "urgent"]), ("vip", ["urgent", "early"])])
def test_priority_counts_only_for_priority_keys(keyed: RunningServer, key: str, order: list[str]) -> None:
    assert _served_order(keyed, key) == order


def test_failed_logins_are_throttled_per_address(keyed: RunningServer) -> None:
    # Linux routes all of 127.0.0.0/8 to loopback: this client comes from another address.
    other = httpx.HTTPTransport(local_address="127.0.0.2")
    with keyed.client(transport=other) as client:
        for _ in range(10):
            assert client.post("/v1/completions", json=SMALL, headers=auth("guess")).status_code == 401
        r = client.post("/v1/completions", json=SMALL, headers=auth("guess"))
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "too_many_failed_logins"
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        # The throttled address is refused before its key is looked at: a guess cannot tell a right key.
        assert client.post("/v1/completions", json=SMALL, headers=auth("plain")).status_code == 429
    with keyed.client() as client:  # from 127.0.0.1: not throttled
        assert client.post("/v1/completions", json=SMALL, headers=auth("guess")).status_code == 401
        assert client.post("/v1/completions", json=SMALL, headers=auth("plain")).status_code == 200
    keyed.wait_idle()


def test_x_forwarded_for_is_ignored_from_a_peer_not_in_forwarded_allow_ips(
    keyed: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # From loopback, which uvicorn's own default trusts: a guesser naming a new client each time
    # must still be one address to the throttle.
    monkeypatch.setattr(keyed.state, "throttle", LoginThrottle(max_failures=2))  # restored after the test
    with keyed.client() as client:
        codes = [
            client.post("/v1/completions", json=SMALL, headers={**auth("guess"), "X-Forwarded-For": f"10.9.9.{i}"})
            for i in range(3)
        ]
    assert [r.status_code for r in codes] == [401, 401, 429]


def test_metrics_needs_a_key_once_keys_are_set(keyed: RunningServer) -> None:
    with keyed.client() as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=auth("plain")).status_code == 200


def test_metrics_public_serves_metrics_without_a_key(chat_model: Path) -> None:
    with (
        run_server(chat_model, ServerConfig(api_keys=("k",), metrics_public=True)) as server,
        server.client() as client,
    ):
        assert client.get("/metrics").status_code == 200
        assert client.get("/v1/models").status_code == 401
