"""The engine core in its own process: the same answers as on a thread, and a process that dies ends
every in-flight request with an error instead of a hang."""

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
    from_process = _greedy(server)
    with run_server(chat_model) as on_thread:
        from_thread = _greedy(on_thread)
    assert from_process == from_thread
    assert from_process[0][0] == from_process[1][0]  # greedy: both samples alike


def test_a_killed_engine_process_errors_in_flight_requests_and_fails_health(chat_model: Path) -> None:
    with run_server(chat_model, engine_process=True) as server:
        client_side = server.engine.client
        assert isinstance(client_side, ProcessCoreClient)
        environ = Path(f"/proc/{client_side.process.pid}/environ")
        if environ.exists() and "OMP_WAIT_POLICY" not in os.environ:  # its OpenMP workers sleep, not spin
            assert b"OMP_WAIT_POLICY=PASSIVE" in environ.read_bytes().split(b"\0")
            assert "OMP_WAIT_POLICY" not in os.environ  # and this process's environment is as it was
        body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        killed: list[bool] = []

        async def stream() -> list[str]:
            frames: list[str] = []
            async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            frames.append(line[6:])
                            if len(frames) == 2 and not killed:  # mid-generation: kill the engine process
                                killed.append(True)
                                os.kill(client_side.process.pid, signal.SIGKILL)
            return frames

        async def main() -> list[list[str]]:
            return await asyncio.wait_for(asyncio.gather(*(stream() for _ in range(3))), 30)

        started = time.monotonic()
        for frames in asyncio.run(main()):
            assert frames[-1] == "[DONE]"
            assert json.loads(frames[-2])["error"]["code"] == "engine_error"
        assert time.monotonic() - started < 20
        with server.client() as client:
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            late = client.post("/v1/completions", json={**body, "stream": False})
            assert late.status_code == 503
