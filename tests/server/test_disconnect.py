"""Clients that go away: their requests are aborted and every KV block comes back."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from tests.server.conftest import RunningServer, long_context_copy, run_server

LONG = {"prompt": "Hello world", "max_tokens": 200, "ignore_eos": True, "stream": True}


async def _drop_after_first_tokens(client: httpx.AsyncClient, i: int) -> int:
    """Open a stream, read until a token arrives, then close the connection mid-generation."""
    body = {**LONG, "prompt": [3 + i % 400, 7, 11, 13 + i % 50]}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                return len(json.loads(line[6:])["choices"])
    raise AssertionError("the stream ended before its first token")


def test_200_dropped_streams_free_every_kv_block(server: RunningServer) -> None:
    async def main() -> None:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            for start in range(0, 200, 50):  # 50 concurrent streams at a time
                got = await asyncio.gather(*(_drop_after_first_tokens(client, i) for i in range(start, start + 50)))
                assert got == [1] * 50

    asyncio.run(main())
    server.wait_idle()  # raises unless every block is free and nothing is in flight
    assert server.engine.snapshot.kv_cache_usage == 0.0
    with server.client() as client:  # still serving
        out = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3


def test_a_non_streaming_client_that_disconnects_is_aborted(chat_model: Path, tmp_path: Path) -> None:
    # Long enough that no engine finishes it before the client's 0.3 s timeout.
    body = {"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True}
    model = long_context_copy(chat_model, tmp_path / "model")
    with run_server(model, engine_process=True, max_model_len=4096, num_kv_blocks=512) as server:

        async def main() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as client:
                try:
                    await client.post("/v1/completions", json=body)
                except httpx.TimeoutException:
                    pass

        started = time.monotonic()
        asyncio.run(main())
        server.wait_idle()
        assert _aborted(server) == 1
        assert time.monotonic() - started < 10


def _aborted(server: RunningServer) -> float:
    sample = server.state.metrics.registry.get_sample_value(
        "tokenmill:request_success_total", {"model_name": server.state.model_name, "finished_reason": "abort"}
    )
    return sample or 0.0
