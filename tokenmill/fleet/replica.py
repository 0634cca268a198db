"""One replica: the whole tokenmill OpenAI app (routes, streaming, auth, limits, metrics) over its own
engine, driven as an ASGI app by requests the ingress forwards through a Ray Serve handle.

Ray Serve calls `check_health` (the engine's own health: a replica whose engine restarts itself passes;
one whose engine is dead or stalled fails, and Ray Serve replaces it after a few failures),
`record_routing_stats` (the load the router reads: queued and running tokens, and this replica's
Prometheus text for the fleet's /metrics) and `record_autoscaling_stats` (queue depth for the
autoscaling policy)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.restart_policy import RestartPolicy
from tokenmill.fleet.logs import use_serve_logging
from tokenmill.server.app import build_app
from tokenmill.server.config import ServerConfig
from tokenmill.server.pool.setup import create_state

logger = logging.getLogger(__name__)

_DISCONNECT_GRACE_S = 5.0  # after the caller leaves, how long the app gets to abort and return


class ReplicaServer:
    """The body of the replica deployment (app.py decorates it with the deployment's options)."""

    # Ray Serve awaits an async constructor: the engine loop must start on the replica's event loop.
    async def __init__(self, engine_args: EngineArgs, config: ServerConfig, num_threads: int) -> None:  # type: ignore[misc]
        # The engine process inherits this; torch reads it when it starts.
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        use_serve_logging()
        from ray import serve

        self.name = serve.get_replica_context().replica_id.unique_id
        engine = AsyncEngine(
            engine_args,
            config.engine_stall_timeout_s,
            engine_process=not config.engine_in_thread,
            restart_policy=RestartPolicy(max_restarts=config.max_engine_restarts),
            step_timeout_s=config.engine_step_timeout_s,
        )
        self.state = create_state(config, engine, engine_args)  # with --registry: every replica's own pool
        self.app = build_app(self.state)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine loop on this replica's event loop
        logger.info("replica %s serves %r with %d threads", self.name, self.state.model_name, num_threads)

    async def handle(
        self, scope: dict[str, Any], body: bytes, routing: dict[str, Any] | None = None
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """Run one HTTP request through the app; yields its ASGI messages, batched as they queue up.
        `routing` is for the request router only. Closing the generator (the client left) is a
        disconnect for the app, which then aborts the request."""
        del routing
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            await queue.put(dict(message))

        task = asyncio.ensure_future(self.app(dict(scope), receive, send))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            done = False
            while not done:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                done = batch[-1] is None or _is_last(batch[-1])
                messages = [m for m in batch if m is not None]
                if messages:
                    yield messages
            await task  # an error in the app itself surfaces here
        finally:
            disconnected.set()
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), _DISCONNECT_GRACE_S)
                task.cancel()

    async def check_health(self) -> None:
        """Raise while the engine is dead or stalled; Ray Serve replaces a replica that keeps failing.
        A restart under way passes: the engine is replacing itself."""
        engine = self.state.engine
        if engine.is_dead:
            raise RuntimeError(f"the engine is dead: {engine.dead_reason}")
        if engine.is_stalled():
            raise RuntimeError("the engine step has stalled")

    def load(self) -> dict[str, int]:
        """Queued and running requests, and their tokens: prompt + max_tokens per sequence."""
        streams = list(self.state.engine.streams.values())
        tokens = sum(len(s.children) * (s.num_prompt_tokens + s.children[0].max_tokens) for s in streams)
        waiting, _ = self.state.engine.waiting_load()
        return {"requests": len(streams), "waiting_requests": waiting, "load_tokens": tokens}

    def record_routing_stats(self) -> dict[str, Any]:
        return {"replica": self.name, **self.load(), "metrics": self.state.metrics.render().decode()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        load = self.load()
        return {"waiting_requests": float(load["waiting_requests"]), "load_tokens": float(load["load_tokens"])}

    async def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica (scale-down, shutdown): drain, then stop the engine.
        state = self.state
        state.draining = True
        if not await state.engine.wait_idle(state.config.shutdown_timeout_s):
            logger.warning("replica %s: aborting %d requests at shutdown", self.name, state.engine.num_in_flight)
        await self._lifespan.__aexit__(None, None, None)


def _is_last(message: dict[str, Any]) -> bool:
    return message.get("type") == "http.response.body" and not message.get("more_body", False)
