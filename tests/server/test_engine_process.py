"""The engine core in its own process: the same answers as on a thread; a process that dies is
replaced (requests under way end with an error, queued ones complete), unless restarts are spent."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import RunningServer, run_server
from tokenmill.engine.core_client import ProcessCoreClient
from tokenmill.engine.restart_policy import RestartPolicy
from tokenmill.server.config import ServerConfig


def _greedy(server: RunningServer) -> list[Any]:
    body = {
        "prompt": [5, 6, 7, 8],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
        "logprobs": 2,
        "echo": True,
    }
    with server.client() as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    return [
        (c["text"], c["logprobs"]["tokens"], c["logprobs"]["top_logprobs"], c["finish_reason"])
        for c in r.json()["choices"]
    ]


def test_process_and_thread_engines_answer_the_same(chat_model: Path, server: RunningServer) -> None:
    assert isinstance(server.engine.client, ProcessCoreClient)
    # The engine process timed its own start-up and sent it with EngineReady.
    names = [name for name, _ in server.engine.phases.phases]
    assert names[-4:] == ["engine imports", "engine model", "engine KV cache", "engine warm-up"]
    from_process = _greedy(server)
    with run_server(chat_model) as on_thread:
        from_thread = _greedy(on_thread)
    assert from_process == from_thread
    assert from_process[0][0] == from_process[1][0]  # greedy: both samples alike


def test_a_killed_engine_process_is_replaced_and_queued_requests_complete(chat_model: Path) -> None:
    # One runs at a time: when the engine dies, the first stream is under way, the second still queued.
    with run_server(chat_model, engine_process=True, max_num_seqs=1) as server:
        client_side = server.engine.client
        assert isinstance(client_side, ProcessCoreClient)
        environ = Path(f"/proc/{client_side.process.pid}/environ")
        if environ.exists() and "OMP_WAIT_POLICY" not in os.environ:  # its OpenMP workers sleep, not spin
            assert b"OMP_WAIT_POLICY=PASSIVE" in environ.read_bytes().split(b"\0")
            assert "OMP_WAIT_POLICY" not in os.environ  # and this process's environment is as it was
        body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
        health: list[tuple[int, str]] = []

        async def watch_health(client: httpx.AsyncClient) -> None:  # until it has failed, then recovered
            while not any(status == 503 for status, _ in health) or health[-1][0] != 200:
                r = await client.get("/health")
                health.append((r.status_code, r.json().get("error", {}).get("code", "ok")))
                await asyncio.sleep(0.05)

        async def stream(client: httpx.AsyncClient, kill: bool) -> list[str]:
            frames: list[str] = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line[6:])
                        if kill and len(frames) == 2:  # mid-generation: kill the engine process
                            os.kill(client_side.process.pid, signal.SIGKILL)
                            asyncio.ensure_future(watch_health(client))
            return frames

        async def main() -> list[list[str]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=180) as client:  # a new engine loads
                first = asyncio.ensure_future(stream(client, kill=True))
                await asyncio.sleep(0.2)  # queued behind the first
                return await asyncio.wait_for(asyncio.gather(first, stream(client, kill=False)), 240)

        under_way, queued = asyncio.run(main())
        assert under_way[-1] == "[DONE]"
        assert json.loads(under_way[-2])["error"]["code"] == "engine_error"
        assert queued[-1] == "[DONE]" and "error" not in queued[-2]  # ran again on the new engine, to the end
        assert json.loads(queued[-2])["choices"][0]["finish_reason"] == "length"
        assert (503, "engine_restarting") in health  # /health said so while the new engine started
        assert server.engine.client is not client_side and server.engine.num_restarts == 1
        with server.client() as client:
            assert client.get("/health").status_code == 200
            late = client.post("/v1/completions", json={**body, "stream": False})
            assert late.status_code == 200


def test_an_engine_that_keeps_dying_ends_dead(chat_model: Path) -> None:
    with run_server(chat_model, engine_process=True, config=ServerConfig()) as server:
        server.engine.restart_policy = RestartPolicy(max_restarts=0)  # restarts off
        client_side = server.engine.client
        assert isinstance(client_side, ProcessCoreClient)
        os.kill(client_side.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        with server.client() as client:
            while client.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            # Public: it says what, not why; the reason is behind the key (and in the log).
            assert "exit code" not in health.text
            assert "exit code" in client.get("/dashboard/data").json()["engine"]["detail"]
            late = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"


def test_a_stopped_engine_process_is_hung_and_replaced_and_its_queued_request_completes(
    server: RunningServer,
) -> None:
    client_side = server.engine.client
    assert isinstance(client_side, ProcessCoreClient)
    restarts = server.engine.num_restarts
    server.engine.watchdog.timeout_s = 2.0
    try:
        os.kill(client_side.process.pid, signal.SIGSTOP)  # alive but never steps again: hung, not dead
        started = time.monotonic()
        with server.client() as client:  # 30 s: the step timeout, then a new engine
            r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - started >= 2.0  # it waited for the step timeout, then ran on a new engine
    finally:
        server.engine.watchdog.timeout_s = None
    assert server.engine.num_restarts == restarts + 1 and server.engine.client is not client_side
    assert not client_side.process.is_alive()  # killed, not left stopped
