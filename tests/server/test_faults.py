"""Fault injection: the model's forward raising mid-run ends every in-flight request with an error
(no hang), /health reports the dead engine, and new requests get 503."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import run_server


def test_a_failing_forward_errors_every_request_and_fails_health(chat_model: Path) -> None:
    with run_server(chat_model, max_num_seqs=4) as server:
        runner = server.core.runner
        real_forward = runner._forward  # every step's forward: eager, fused decode stack or CUDA graph
        calls = {"n": 0}

        def flaky_forward(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] > 5:  # some steps succeed, so requests are mid-generation
                raise RuntimeError("injected fault: device lost")
            return real_forward(*args, **kwargs)

        runner._forward = flaky_forward  # type: ignore[method-assign]
        body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True}

        async def one(client: httpx.AsyncClient, i: int) -> tuple[int, Any]:
            if i % 2:
                r = await client.post("/v1/completions", json=body)
                return r.status_code, r.json()
            frames = []
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line[6:])
            return r.status_code, frames

        async def main() -> list[tuple[int, Any]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
                return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(8))), 30)

        results = asyncio.run(main())
        for i, (status, body_or_frames) in enumerate(results):
            if i % 2:  # unstreamed: a 500 with a stable message and no traceback
                assert status == 500
                assert body_or_frames["error"]["code"] == "engine_error"
                assert "Traceback" not in json.dumps(body_or_frames)
            else:  # streamed: an error frame, then [DONE]
                assert status == 200
                assert body_or_frames[-1] == "[DONE]"
                assert json.loads(body_or_frames[-2])["error"]["code"] == "engine_error"
        with server.client() as client:
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            assert client.get("/ready").status_code == 503
            late = client.post("/v1/completions", json=body)
            assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
