"""Memory-pressure admission: while the KV cache is nearly full and the queue already holds a nearly
full cache's worth of prompt tokens, new requests get 503 with Retry-After instead of queueing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tests.server.conftest import run_server
from tokenmill.server.config import ServerConfig

_BODY = {"prompt": "Hello", "max_tokens": 4}


def test_a_full_cache_with_a_full_queue_answers_503(chat_model: Path) -> None:
    with run_server(chat_model, num_kv_blocks=64) as server:
        engine = server.engine
        capacity = engine.num_blocks * engine.config.cache.block_size
        idle = engine.snapshot
        # What an engine reports under pressure (it is idle here, so nothing overwrites it).
        engine.snapshot = dataclasses.replace(idle, kv_cache_usage=0.97, num_waiting_tokens=capacity)
        with server.client() as client:
            r = client.post("/v1/completions", json=_BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "memory_pressure"
            assert r.headers["Retry-After"] == "2"
            # A full cache with a short queue still queues (running requests will free blocks soon) ...
            engine.snapshot = dataclasses.replace(idle, kv_cache_usage=0.97, num_waiting_tokens=capacity // 4)
            assert client.post("/v1/completions", json=_BODY).status_code == 200
            # ... and so does a long queue while the cache has room.
            engine.snapshot = dataclasses.replace(idle, kv_cache_usage=0.5, num_waiting_tokens=capacity)
            assert client.post("/v1/completions", json=_BODY).status_code == 200


def test_the_check_can_be_turned_off(chat_model: Path) -> None:
    with run_server(chat_model, ServerConfig(memory_pressure_threshold=None), num_kv_blocks=64) as server:
        engine = server.engine
        capacity = engine.num_blocks * engine.config.cache.block_size
        engine.snapshot = dataclasses.replace(engine.snapshot, kv_cache_usage=1.0, num_waiting_tokens=capacity)
        with server.client() as client:
            assert client.post("/v1/completions", json=_BODY).status_code == 200
