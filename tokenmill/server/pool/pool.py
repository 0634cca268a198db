"""The model pool: one engine (its own process, its own KV cache) per loaded model, loaded when a request
first names it, unloaded when idle past --keep-alive, and bounded by --max-loaded-models and
--memory-budget-gb (the least recently used idle model makes room; a load that cannot fit is a 503).

A request holds a Lease on its model from lookup until its handler returns; its engine requests keep the
model busy after that (a stream still running). Unloading drains: a model marked draining takes no new
requests, and its engine stops once both are done, so an alias moved away from it loses no request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics.prometheus import ServerMetrics
from tokenmill.registry import RegistryCorruptError, UnknownModelError
from tokenmill.registry.describe import describe
from tokenmill.server.config import PoolConfig, ServerState
from tokenmill.server.errors import APIError
from tokenmill.server.pool.access import KeyAccess
from tokenmill.server.pool.catalog import Catalog, ModelEntry
from tokenmill.server.pool.estimate import GIB, kv_cache_bytes, weight_bytes
from tokenmill.server.pool.metrics import PoolMetrics
from tokenmill.server.pool.quota import LoadQuota

logger = logging.getLogger(__name__)

ModelStatus = Literal["not_loaded", "loading", "ready", "draining"]
NewEngine = Callable[[EngineArgs], AsyncEngine]
RETRY_AFTER_S = 5  # a 503 for room: about the time an idle model takes to free its place


@dataclass(eq=False)
class LoadedModel:
    """A model with an engine: loading, ready or draining."""

    entry: ModelEntry
    estimate_bytes: int
    ready: asyncio.Future[None] | None  # done once loaded (the error, if it failed); None: loaded at start
    status: ModelStatus = "loading"
    state: ServerState | None = None  # once ready: the routes' view of this model
    leases: int = 0  # requests holding it (waiting for its load, or in their handler)
    last_used: float = field(default_factory=time.monotonic)
    pinned: bool = False  # the default model: never unloaded
    load_seconds: float | None = None

    @property
    def busy(self) -> bool:
        return self.leases > 0 or (self.state is not None and self.state.engine.num_in_flight > 0)

    @property
    def pid(self) -> int | None:
        """The engine process's id (None when the engine runs on a thread)."""
        process = getattr(self.state.engine.client, "process", None) if self.state is not None else None
        return process.pid if process is not None else None


class Lease:
    """A request's hold on its model; `release` once its handler is done."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self._released = False

    @property
    def state(self) -> ServerState:
        assert self.model.state is not None  # leases are handed out for ready models only
        return self.model.state

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.model.leases -= 1
            self.model.last_used = time.monotonic()


class ModelPool:
    """The loaded models by id (`name@version`, an extra model's name, the default model's served name).

    Usage (the app does this)::

        pool = ModelPool(state, engine_args, Catalog(Registry(dir)), PoolConfig(...), None, new_engine)
        pool.start()  # in the event loop: the keep-alive reaper
        async with state_for_model(state, "smol-stable", key) as model_state:
            ...  # the completion handlers, run on model_state
        await pool.close()
    """

    def __init__(
        self,
        main: ServerState,
        main_args: EngineArgs,
        catalog: Catalog,
        config: PoolConfig,
        access: KeyAccess | None,
        new_engine: NewEngine,
    ) -> None:
        self.main, self.catalog, self.config, self.access = main, catalog, config, access
        self._args = dataclasses.replace(main_args, speculative_config=None, generation_config="auto")
        self._new_engine = new_engine
        self._quota = LoadQuota(config.model_loads_per_hour or None)
        self._models: dict[str, LoadedModel] = {}
        self.metrics = PoolMetrics(self._registries)
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        main_model = LoadedModel(
            ModelEntry(main.model_name, main.model_name, None, Path(main_args.model or ""), 0, "", 0),
            self._main_estimate(main_args),
            None,
            status="ready",
            state=main,
            pinned=True,
        )
        self._models[main.model_name] = main_model
        self.metrics.models_loaded.set(1)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the keep-alive reaper; call inside the server's event loop."""
        if self.config.keep_alive_s is not None:
            self._reaper = asyncio.ensure_future(self._reap_idle(self.config.keep_alive_s))

    async def close(self) -> None:
        """Stop every pooled engine (not the default one: the app stops it)."""
        self._closed = True  # a load finishing after this stops its engine at once
        if self._reaper is not None:
            self._reaper.cancel()
        for model in [m for m in self._models.values() if not m.pinned]:
            if model.state is not None:
                model.state.engine.abort_all()
                await asyncio.to_thread(model.state.engine.shutdown)
        self._models.clear()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # evictions and unloads under way

    async def drain_all(self, timeout_s: float) -> None:
        """On shutdown: the pooled models' requests get `timeout_s` to finish, then the rest are aborted."""
        pooled = [m for m in self._models.values() if not m.pinned]
        await asyncio.gather(*(self._drain(m, timeout_s) for m in pooled))

    def log_throughput(self) -> None:
        """Update the pooled models' throughput gauges (the default model's are the app's to update)."""
        for model in self._models.values():
            if not model.pinned and model.state is not None:
                model.state.metrics.log_throughput()

    # ------------------------------------------------------------------ requests
    async def acquire(self, model_id: str | None, key: str) -> Lease:
        """The model a request names (None: the default), loaded if need be: 404 for an unknown model, 403
        for one the key may not use, 503 when it cannot be loaded now."""
        self.main.check_accepting()
        entry = self.lookup(model_id)
        requested = model_id or entry.id
        if self.access is not None and not self.access.allows(key, (requested, entry.id, entry.name)):
            raise APIError(403, f"this API key may not use the model {requested!r}.", "model_not_allowed", "model")
        return await self._hold(entry, key)

    async def _hold(self, entry: ModelEntry, key: str | None) -> Lease:
        """A lease on the entry's model once it is ready, starting its load if it has none (charged to `key`;
        None: the admin API's, not charged)."""
        model = self._models.get(entry.id)
        if model is not None and not model.pinned and model.state is not None and model.state.engine.is_dead:
            logger.warning("%s's engine is dead (%s): loading it again", entry.id, model.state.engine.dead_reason)
            self._models.pop(entry.id)
            self._spawn(self._stop(model))
            model = None
        if model is None:
            model = self._begin_load(entry, key)
        if model.status == "draining":
            raise APIError(
                503,
                f"the model {entry.id} is being unloaded; retry shortly.",
                "model_draining",
                headers={"Retry-After": "1"},
            )
        model.leases += 1  # before waiting: a model someone waits for is not idle, so never evicted
        lease = Lease(model)
        if model.ready is not None:
            try:
                await asyncio.shield(model.ready)
            except BaseException:
                lease.release()
                raise
        return lease

    def lookup(self, model_id: str | None) -> ModelEntry:
        """The entry a request's model resolves to (404 model_not_found if none)."""
        if model_id is None or model_id == self.main.model_name:
            return self._models[self.main.model_name].entry
        try:
            return self.catalog.resolve(model_id)
        except UnknownModelError:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist; GET /v1/models lists what this server serves.",
                "model_not_found",
                "model",
            ) from None

    def status(self, model_id: str) -> ModelStatus:
        model = self._models.get(model_id)
        return model.status if model is not None else "not_loaded"

    def loaded(self) -> list[LoadedModel]:
        return list(self._models.values())

    # ------------------------------------------------------------------ loading
    async def load(self, model_id: str) -> LoadedModel:
        """Load a model now (the admin route; no key's access list applies); a no-op for one loaded."""
        lease = await self._hold(self.lookup(model_id), None)
        lease.release()
        return lease.model

    def _begin_load(self, entry: ModelEntry, key: str | None) -> LoadedModel:
        loading = sum(1 for m in self._models.values() if m.status == "loading")
        if loading >= self.config.max_loading_models:
            raise APIError(
                503,
                f"{loading} models are loading already (the server's --max-loading-models); retry shortly.",
                "model_pool_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if key is not None:  # charged before the load starts: a refused or failed load is paid for too
            self.main.limiter.acquire(key, 0)  # a load counts as one request of the key's rate limit
            self._quota.charge(key)
        estimate = self._estimate(entry)
        self._make_room(entry.id, estimate)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # waiters may all have left
        model = LoadedModel(entry, estimate, future)
        self._models[entry.id] = model
        self.metrics.models_loaded.set(len(self._models))
        self._spawn(self._load(model, future))
        return model

    async def _load(self, model: LoadedModel, ready: asyncio.Future[None]) -> None:
        entry, started = model.entry, time.monotonic()
        logger.info("loading %s from %s", entry.id, entry.path)
        try:
            await asyncio.to_thread(self.catalog.verify, entry)
            engine = await asyncio.to_thread(self._new_engine, dataclasses.replace(self._args, model=str(entry.path)))
        except Exception as exc:  # noqa: BLE001 - every load failure becomes the waiters' error
            self._models.pop(entry.id, None)
            self.metrics.models_loaded.set(len(self._models))
            ready.set_exception(_load_error(entry, exc))
            return
        if self._closed:
            await asyncio.to_thread(engine.shutdown)
            ready.set_exception(APIError(503, "the server is shutting down.", "shutting_down"))
            return
        engine.start()
        metrics = ServerMetrics(entry.id)
        engine.stats = metrics
        model.state = dataclasses.replace(self.main, engine=engine, model_name=entry.id, metrics=metrics, routed=True)
        model.load_seconds = time.monotonic() - started
        self.metrics.load_seconds.labels(entry.id).observe(model.load_seconds)
        model.status = "ready"
        model.last_used = time.monotonic()
        logger.info("loaded %s in %.2f s", entry.id, model.load_seconds)
        ready.set_result(None)

    def _make_room(self, model_id: str, estimate: int) -> None:
        """Evict idle models, least recently used first, until `estimate` more bytes and one more model fit
        the bounds; else a 503 (Retry-After) that names what is in the way."""
        budget = None if self.config.memory_budget_gb is None else int(self.config.memory_budget_gb * GIB)
        pinned = sum(m.estimate_bytes for m in self._models.values() if m.pinned)
        if budget is not None and pinned + estimate > budget:
            raise APIError(
                503,
                f"the model {model_id} needs about {estimate / GIB:.2f} GiB (weights + KV cache), more than the "
                f"memory budget of {budget / GIB:.2f} GiB leaves beside the default model; raise "
                "--memory-budget-gb or lower --kv-cache-memory-gb.",
                "model_does_not_fit",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        while not self._fits(estimate, budget):
            idle = [m for m in self._models.values() if m.status == "ready" and not m.pinned and not m.busy]
            if not idle:
                raise APIError(
                    503,
                    f"no room to load {model_id}: the {len(self._models)} loaded models are all busy; retry shortly.",
                    "model_pool_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            victim = min(idle, key=lambda m: m.last_used)
            logger.info("evicting %s (least recently used, idle) to load %s", victim.entry.id, model_id)
            self._models.pop(victim.entry.id)
            self._spawn(self._stop(victim))

    def _fits(self, estimate: int, budget: int | None) -> bool:
        limit = self.config.max_loaded_models
        if limit is not None and len(self._models) + 1 > limit:
            return False
        return budget is None or sum(m.estimate_bytes for m in self._models.values()) + estimate <= budget

    # ------------------------------------------------------------------ unloading
    async def unload(self, model_id: str, drain_timeout_s: float | None = None) -> LoadedModel:
        """Unload a model after its requests finish (aborted past `drain_timeout_s`, by default the
        server's shutdown timeout); the default model cannot be unloaded."""
        entry = self.lookup(model_id)
        model = self._models.get(entry.id)
        if model is None:
            raise APIError(409, f"the model {entry.id} is not loaded.", "model_not_loaded", "model")
        if model.pinned:
            raise APIError(409, f"{entry.id} is the default model; it stays loaded.", "model_pinned", "model")
        if model.status == "loading" and model.ready is not None:
            await asyncio.shield(model.ready)
        if model.status != "draining":
            model.status = "draining"
            await self._drain(
                model, self.main.config.shutdown_timeout_s if drain_timeout_s is None else drain_timeout_s
            )
            if self._models.get(entry.id) is model:
                self._models.pop(entry.id)
                await self._stop(model)
        return model

    async def _drain(self, model: LoadedModel, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while model.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if model.busy and model.state is not None:
            logger.warning("aborting %d requests still on %s", model.state.engine.num_in_flight, model.entry.id)
            model.state.engine.abort_all()

    async def _stop(self, model: LoadedModel) -> None:
        """Stop the engine (its process exits and frees its memory) and record how long that took."""
        started = time.monotonic()
        self.metrics.models_loaded.set(len(self._models))
        if model.state is not None:
            await asyncio.to_thread(model.state.engine.shutdown)
        model.status = "not_loaded"
        seconds = time.monotonic() - started
        self.metrics.unload_seconds.labels(model.entry.id).observe(seconds)
        logger.info("unloaded %s in %.2f s", model.entry.id, seconds)

    async def _reap_idle(self, keep_alive_s: float) -> None:
        while True:
            await asyncio.sleep(min(1.0, keep_alive_s / 4))
            now = time.monotonic()
            for model in list(self._models.values()):
                if model.pinned or model.status != "ready":
                    continue
                if model.busy:
                    model.last_used = now  # a stream still running counts as use
                elif now - model.last_used >= keep_alive_s:
                    logger.info("unloading %s: idle for %.0f s", model.entry.id, now - model.last_used)
                    self._models.pop(model.entry.id)
                    self._spawn(self._stop(model))

    # ------------------------------------------------------------------ helpers
    def _estimate(self, entry: ModelEntry) -> int:
        args = self._args
        return weight_bytes(entry.parameters, entry.dtype, entry.file_bytes, args) + kv_cache_bytes(entry.path, args)

    def _main_estimate(self, args: EngineArgs) -> int:
        path = Path(args.model or "")
        if not path.exists():
            return 0  # a preset or the embedded default: no folder to read here
        try:
            info = describe(path)
        except ValueError:
            return 0
        size = path.stat().st_size if path.is_file() else 0
        return weight_bytes(info.parameters, info.dtype, size, args) + kv_cache_bytes(path, args)

    def _registries(self) -> Iterator[CollectorRegistry]:
        return (m.state.metrics.registry for m in self._models.values() if m.state is not None)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _load_error(entry: ModelEntry, exc: Exception) -> APIError:
    """The waiters' error. Generic: the exception names files and paths on the server, for its log only."""
    if isinstance(exc, RegistryCorruptError):
        logger.error("cannot load %s: %s", entry.id, exc)
        return APIError(
            500,
            f"the model {entry.id} cannot be loaded: its files do not match its registry manifest (the server's "
            f"operator can check it with `tokenmill models verify {entry.id}`).",
            "model_corrupt",
            "model",
        )
    logger.error("loading %s failed", entry.id, exc_info=exc)
    return APIError(
        500, f"the model {entry.id} failed to load; the server's log has the reason.", "model_load_failed", "model"
    )


@contextlib.asynccontextmanager
async def state_for_model(state: ServerState, model_id: str | None, key: str) -> AsyncIterator[ServerState]:
    """The state a request for `model_id` runs on: the server's own without a pool, else the pooled
    model's (loaded if need be), held until the handler is done."""
    if state.models is None:
        yield state
        return
    lease = await state.models.acquire(model_id, key)
    try:
        yield lease.state
    finally:
        lease.release()
