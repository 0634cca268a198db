"""The live dashboard at /dashboard: a static page (package data, no CDN) that polls /dashboard/data,
which a once-a-second sampler of the server's own Prometheus registry fills (history.py). The
sampler also refreshes the registry's process, device and cost gauges, and with
--otlp-traces-endpoint the request spans are set up here too.

    dashboard = Dashboard(state)
    app.include_router(dashboard.router)  # and run dashboard.run() as a task while serving
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from importlib.resources import files
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenmill.engine.core_client import ProcessCoreClient
from tokenmill.metrics.operations import OperatorSettings
from tokenmill.metrics.tracing import RequestTracer
from tokenmill.server.config import ServerState
from tokenmill.server.dashboard.errors import ErrorTracker
from tokenmill.server.dashboard.history import INTERVAL_S, History
from tokenmill.server.dashboard.samples import Samples, per_bucket
from tokenmill.server.errors import error_response
from tokenmill.server.health import engine_trouble

logger = logging.getLogger(__name__)
_STATIC = files("tokenmill.server.dashboard") / "static"
_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
DASHBOARD_PAGE = "/dashboard"
DASHBOARD_STATIC = "/dashboard/static/"


class Dashboard:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        cfg = state.config
        self.settings = OperatorSettings(
            slo_ttft_s=None if cfg.slo_ttft_ms is None else cfg.slo_ttft_ms / 1000,
            slo_itl_s=None if cfg.slo_itl_ms is None else cfg.slo_itl_ms / 1000,
            throughput_baseline=cfg.throughput_baseline,
            cost_per_hour=cfg.cost_per_hour,
        )
        self.ops = state.metrics.ops
        self.ops.configure(self.settings)
        self.history = History(state.metrics.registry, cfg.throughput_baseline)
        self.errors = ErrorTracker(self.ops, state.model_name)
        if cfg.otlp_traces_endpoint is not None:  # the request spans share the metrics' finish hook
            self.ops.tracer = RequestTracer(cfg.otlp_traces_endpoint, f"tokenmill:{state.model_name}")
        self.router = self._routes()

    def close(self) -> None:
        """Flush the spans still queued (blocks up to the exporter's timeout)."""
        if self.ops.tracer is not None:
            self.ops.tracer.shutdown()

    async def run(self) -> None:
        """Sample once a second until cancelled."""
        while True:
            try:
                self.sample()
            except Exception:  # a failed read must not end the history; the next second tries again
                logger.exception("dashboard sample failed")
            await asyncio.sleep(INTERVAL_S)

    def sample(self) -> None:
        engine = self.state.engine
        client = engine.client
        pid = client.process.pid if isinstance(client, ProcessCoreClient) else None
        self.ops.set_engine(pid, engine.num_blocks)
        self.ops.engine_up.set(0 if engine.is_dead or engine.restarting is not None else 1)
        self.ops.sample(self.history.window_tokens_per_s())
        self.history.sample()

    def data(self, since: float) -> dict[str, Any]:
        now = Samples(self.state.metrics.registry)
        s = self.settings
        return {
            "now": time.time(),
            "model": self.state.model_name,
            "interval_s": INTERVAL_S,
            "settings": {
                "slo_ttft_s": s.slo_ttft_s,
                "slo_itl_s": s.slo_itl_s,
                "throughput_baseline": s.throughput_baseline,
                "cost_per_hour": s.cost_per_hour,
                "num_blocks": self.state.engine.num_blocks,
            },
            "points": self.history.since(since),
            "distributions": {
                "batch_size": _json_buckets(now.buckets("tokenmill:batch_size")),
                "queue_time_s": _json_buckets(now.buckets("tokenmill:request_queue_time_seconds")),
            },
            "errors": {"totals": now.by("tokenmill:request_errors_total", "type"), "recent": list(self.errors.recent)},
            "scaling_events": list(self.history.scaling_events),
            "metrics": now.flat(),
            "engine": _engine_status(self.state),
        }

    def _routes(self) -> APIRouter:
        router = APIRouter(include_in_schema=False)

        @router.get(DASHBOARD_PAGE)
        async def page() -> HTMLResponse:
            return HTMLResponse((_STATIC / "index.html").read_text())

        @router.get(DASHBOARD_STATIC + "{name}")
        async def asset(name: str) -> Response:
            if name not in _ASSETS:
                return error_response(404, "no such dashboard file.")
            return Response((_STATIC / name).read_text(), media_type=_ASSETS[name])

        @router.get("/dashboard/data")
        async def data(since: float = 0.0) -> JSONResponse:
            return JSONResponse(self.data(since))

        return router


def _json_buckets(cumulative: list[tuple[float, float]]) -> list[tuple[float | str, float]]:
    """Each bucket's own count, its bound as JSON can carry it (+Inf as a string)."""
    return [(le if math.isfinite(le) else "+Inf", n) for le, n in per_bucket(cumulative)]


def _engine_status(state: ServerState) -> dict[str, str | None]:
    """The engine's state and, behind the API key, why it is not up (public /health does not say)."""
    trouble = engine_trouble(state.engine)
    return {"state": "ok", "detail": None} if trouble is None else {"state": trouble.code, "detail": trouble.detail}
