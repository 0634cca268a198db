"""Fault injection: a model step that raises ends only the requests in that step (the rest, and
later requests, complete); model steps failing in a row end the engine, and a new one takes over;
so does a step that hangs past the step timeout."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import MODEL_NAME, RunningServer, run_server

_BODY = {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True}


async def _one(client: httpx.AsyncClient, stream: bool) -> tuple[int, Any]:
    if not stream:
        r = await client.post("/v1/completions", json=_BODY)
        return r.status_code, r.json()
    frames = []
    async with client.stream("POST", "/v1/completions", json={**_BODY, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
    return r.status_code, frames


def _failed(status: int, body_or_frames: Any) -> bool:
    """An engine error, as the client sees it: a 500 without a traceback, or an error frame then [DONE]."""
    if isinstance(body_or_frames, dict):
        assert "Traceback" not in json.dumps(body_or_frames)
        return status == 500 and body_or_frames["error"]["code"] == "engine_error"
    assert status == 200 and body_or_frames[-1] == "[DONE]"
    last = json.loads(body_or_frames[-2])
    return "error" in last and last["error"]["code"] == "engine_error"


def _run_all(server: RunningServer, count: int) -> list[tuple[int, Any]]:
    async def main() -> list[tuple[int, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, i % 2 == 0) for i in range(count))), 90)

    return asyncio.run(main())


def test_a_failing_step_ends_only_its_requests(chat_model: Path) -> None:
    # Two run at a time: the step that raises holds two requests, the other two wait.
    with run_server(chat_model, max_num_seqs=2) as server:
        core = server.core
        runner = core.runner
        real_forward = runner._forward  # every step's forward: eager, fused decode stack or CUDA graph
        struck = threading.Event()

        def flaky_forward(*args: Any, **kwargs: Any) -> Any:
            # Once, when all four are in (two running, two waiting), so the failing step holds two of them.
            if not struck.is_set() and len(core.scheduler.requests) >= 4:
                struck.set()
                raise RuntimeError("injected fault: out of memory")
            return real_forward(*args, **kwargs)

        runner._forward = flaky_forward  # type: ignore[method-assign]
        results = _run_all(server, 4)
        failed = [_failed(*r) for r in results]
        assert sum(failed) == 2, results
        with server.client() as client:
            assert client.get("/health").json() == {"status": "ok"}
            late = client.post("/v1/completions", json=_BODY)
            assert late.status_code == 200 and late.json()["choices"][0]["finish_reason"] == "length"
            assert "tokenmill:engine_restarts_total" in client.get("/metrics").text
        assert server.engine.num_restarts == 0 and server.core.runner is runner


def test_steps_failing_in_a_row_restart_the_engine(chat_model: Path) -> None:
    with run_server(chat_model, max_num_seqs=4) as server:
        old_core = server.core
        lost = threading.Event()

        def broken_forward(*args: Any, **kwargs: Any) -> Any:
            # The device is "lost" at the first step: every step fails from then on. That step waits until
            # the front end holds all four requests, so none can finish first on a slow machine (failing
            # after a fixed number of steps let a late request reach the new engine and succeed).
            deadline = time.monotonic() + 10
            while not lost.is_set() and len(server.engine.streams) < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
            lost.set()
            raise RuntimeError("injected fault: device lost")

        old_core.runner._forward = broken_forward  # type: ignore[method-assign]
        results = _run_all(server, 4)
        assert all(_failed(*r) for r in results), results  # a step failed with all four in it
        with server.client() as client:
            # More failed steps until three in a row have failed: the engine is broken, a new one starts.
            # (The four above may have failed in one step or in two, as they reached the engine.)
            while old_core.num_failed_steps < 3:
                r = client.post("/v1/completions", json=_BODY)
                assert _failed(r.status_code, r.json())
            for _ in range(600):  # the new engine loads the model again
                if client.get("/health").status_code == 200:
                    break
                time.sleep(0.1)
            assert client.get("/health").json() == {"status": "ok"}
            late = client.post("/v1/completions", json=_BODY)
            assert late.status_code == 200 and late.json()["choices"][0]["finish_reason"] == "length"
            metrics = client.get("/metrics").text
        assert server.engine.num_restarts == 1 and server.core is not old_core
        assert f'tokenmill:engine_restarts_total{{model_name="{MODEL_NAME}"}} 1.0' in metrics


def test_a_hung_step_restarts_the_engine_as_a_death_does(chat_model: Path) -> None:
    # One runs at a time: when a step hangs, one stream is under way, the other still queued.
    with run_server(chat_model, max_num_seqs=1) as server:
        server.engine.watchdog.timeout_s = 2.0
        old_core = server.core
        real_forward = old_core.runner._forward
        release = threading.Event()
        calls = {"n": 0}

        def hanging_forward(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 4:  # a few tokens into the first stream: this step never returns by itself
                release.wait(30)
            return real_forward(*args, **kwargs)

        old_core.runner._forward = hanging_forward  # type: ignore[method-assign]
        started = time.monotonic()
        try:
            results = _run_all_streamed(server, 2)
        finally:
            release.set()  # let the abandoned engine thread end
        assert time.monotonic() - started < 25  # not the 30 s the step hung for
        failed = [_failed(*r) for r in results]
        assert sorted(failed) == [False, True], results  # the stream under way ends with an error event
        done = results[failed.index(False)][1]  # the queued one ran again on the new engine, to the end
        assert json.loads(done[-2])["choices"][0]["finish_reason"] == "length"
        assert server.engine.num_restarts == 1 and server.core is not old_core
        with server.client() as client:
            assert client.get("/health").json() == {"status": "ok"}


def _run_all_streamed(server: RunningServer, count: int) -> list[tuple[int, Any]]:
    async def main() -> list[tuple[int, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, True) for _ in range(count))), 90)

    return asyncio.run(main())
