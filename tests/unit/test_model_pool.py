"""The model pool's limits on on-demand loads (issue 47), with engines that only record that they started:
a key's load quota and rate limit are charged before a load starts, loads at once are capped, a failed
load tells the client nothing of the server's files, and an alias move waits for the registry's lock on a
worker thread, up to a timeout that answers a clear error."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics.prometheus import ServerMetrics
from tokenmill.registry import Registry
from tokenmill.registry.files import exclusive_lock
from tokenmill.server.config import PoolConfig, ServerConfig, ServerState
from tokenmill.server.errors import APIError
from tokenmill.server.pool.catalog import Catalog
from tokenmill.server.pool.pool import ModelPool
from tokenmill.server.security import ApiKeys, RateLimiter


class FakeEngine:
    """What the pool touches of an engine; starting it costs nothing."""

    is_dead = False
    dead_reason = None
    num_in_flight = 0
    client = None
    stats: Any = None

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def abort_all(self) -> None:
        pass


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Registry:
    """m@1, m@2, m@3 (one tiny model's files); bad@1 with a rewritten weight file."""
    root = tmp_path_factory.mktemp("pool")
    source = make_tiny_model(root / "src", "llama")
    reg = Registry(root / "registry")
    for _ in range(3):
        reg.add("m", source)
    bad = reg.add("bad", source, copy=True)
    weights = bad.files_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(weights, 0o644)
    weights.write_bytes(bytes(data))
    return reg


class Pool:
    """A pool over the registry whose engine starts are recorded (and can be held, or made to fail)."""

    def __init__(self, registry: Registry, requests_per_min: int | None = None, **pool_fields: Any) -> None:
        self.started: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.failure: Exception | None = None
        config = ServerConfig(
            requests_per_min=requests_per_min, models=PoolConfig(registry=str(registry.root), **pool_fields)
        )
        engine = cast(AsyncEngine, FakeEngine())
        main = ServerState(config, engine, "main", ServerMetrics("main"), ApiKeys([]), RateLimiter(requests_per_min))
        self.pool = ModelPool(main, EngineArgs(), Catalog(registry), config.models, None, self._new_engine)

    def _new_engine(self, args: EngineArgs) -> AsyncEngine:
        self.started.append(Path(args.model or "").parent.name)  # models/<name>/<version>/files
        self.gate.wait(10)
        if self.failure is not None:
            raise self.failure
        return cast(AsyncEngine, FakeEngine())

    async def use(self, model_id: str, key: str) -> None:
        (await self.pool.acquire(model_id, key)).release()

    async def refused(self, model_id: str, key: str) -> APIError:
        with pytest.raises(APIError) as caught:
            await self.use(model_id, key)
        return caught.value


def test_a_key_past_its_load_quota_is_refused_before_the_load(registry: Registry) -> None:
    pool = Pool(registry, model_loads_per_hour=2)

    async def run() -> APIError:
        await pool.use("m@1", "k")
        await pool.use("m@2", "k")
        refused = await pool.refused("m@3", "k")
        await pool.use("m@1", "k")  # a loaded model costs no load
        await pool.use("m@3", "other")  # another key has loads of its own
        await pool.pool.close()
        return refused

    refused = asyncio.run(run())
    assert refused.status == 429 and refused.code == "model_load_quota_exceeded"
    assert 0 < int(refused.headers["Retry-After"]) <= 3600
    assert pool.started == ["1", "2", "3"]  # m@3 once, for the other key


def test_a_load_is_charged_to_the_keys_rate_limit_before_it_starts(registry: Registry) -> None:
    pool = Pool(registry, requests_per_min=1)

    async def run() -> APIError:
        await pool.use("m@1", "k")
        refused = await pool.refused("m@2", "k")
        await pool.pool.close()
        return refused

    refused = asyncio.run(run())
    assert refused.status == 429 and refused.code == "rate_limit_exceeded"
    assert pool.started == ["1"]  # m@2 never began to load


def test_loads_at_once_are_capped(registry: Registry) -> None:
    pool = Pool(registry, max_loading_models=1)
    pool.gate.clear()  # the first load takes its time

    async def run() -> APIError:
        first = asyncio.ensure_future(pool.use("m@1", "k"))
        while not pool.started:
            await asyncio.sleep(0.01)
        refused = await pool.refused("m@2", "k")
        pool.gate.set()
        await first
        await pool.use("m@2", "k")  # once m@1 is loaded, there is room to load another
        await pool.pool.close()
        return refused

    refused = asyncio.run(run())
    assert refused.status == 503 and refused.code == "model_pool_busy" and refused.headers["Retry-After"]
    assert pool.started == ["1", "2"]


def test_a_failed_load_tells_the_client_nothing_of_the_servers_files(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    pool = Pool(registry)
    pool.failure = RuntimeError("cannot open /srv/secret/m/model.safetensors")

    async def run() -> tuple[APIError, APIError]:
        failed = await pool.refused("m@1", "k")
        corrupt = await pool.refused("bad@1", "k")
        await pool.pool.close()
        return failed, corrupt

    with caplog.at_level(logging.ERROR, logger="tokenmill.server.pool.pool"):
        failed, corrupt = asyncio.run(run())
    assert failed.status == 500 and failed.code == "model_load_failed"
    assert failed.message == "the model m@1 failed to load; the server's log has the reason."
    assert (
        corrupt.status == 500 and corrupt.code == "model_corrupt" and "tokenmill models verify bad@1" in corrupt.message
    )
    for error in (failed, corrupt):
        assert "/" not in error.message.replace("tokenmill models", "") and "sha256" not in error.message
    assert "/srv/secret/m/model.safetensors" in caplog.text and "sha256 differs" in caplog.text  # the detail: the log


@pytest.fixture
def held_registry_lock(registry: Registry) -> Iterator[None]:
    with exclusive_lock(registry.root / ".lock"):  # another writer, holding on
        yield


def test_an_alias_move_waits_for_the_lock_off_the_event_loop_and_times_out_clearly(
    registry: Registry, held_registry_lock: None
) -> None:
    catalog = Catalog(Registry(registry.root, lock_timeout_s=0.5))
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def run() -> APIError:
        ticker = asyncio.ensure_future(tick())
        with pytest.raises(APIError) as caught:
            await catalog.move_alias("stable", "m@1")
        ticker.cancel()
        return caught.value

    refused = asyncio.run(run())
    assert refused.status == 503 and refused.code == "registry_busy" and refused.headers["Retry-After"]
    assert ticks >= 10  # the loop kept running while the move waited 0.5 s
    assert registry.aliases() == {}
