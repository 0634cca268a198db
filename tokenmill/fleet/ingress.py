"""The fleet's HTTP entry, behind Ray Serve's proxy: checks the caller's key from the headers, reads
the body under the server's cap and deadline (front_door.py), works out its routing hints (prefix keys,
token load), and relays it to a replica through a handle whose router is LLMRequestRouter (router.py);
the replica's ASGI messages come back as they are produced (streams stay streams).

A request whose replica fails before answering anything (the replica died, or it is draining) is
sent again to another, up to `max_attempts` sends; a stream cut in the middle ends with an error
event: never silently. /admin/... goes to every replica (admin.py): each has its own model pool.
/metrics is answered here: the fleet's own metrics plus every replica's, labelled with its replica.
With prefill replicas (--prefill-replicas), a long prompt first goes to one of them to leave its KV
blocks in the shared tier folder (disaggregation.py); a prefill hop that fails costs only time: the
decode replica then computes the prompt itself.
The ingress also watches the replica count and logs every scaling event."""

# No `from __future__ import annotations` here: FastAPI reads the route methods' annotations after Ray
# Serve has rebuilt them, and cannot resolve them from strings there.
import asyncio
import logging
from dataclasses import asdict, replace
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Scope

from tokenmill.fleet.admin import collect, fan_out
from tokenmill.fleet.config import FleetConfig
from tokenmill.fleet.disaggregation import prefill_body, takes_prefill_hop
from tokenmill.fleet.front_door import FrontDoor
from tokenmill.fleet.logs import use_serve_logging
from tokenmill.fleet.metrics import FleetMetrics
from tokenmill.fleet.relay import Relay, retryable
from tokenmill.fleet.routing import ROLE, RoutingHints, hints_from_body
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import error_body
from tokenmill.server.pool.admin import ADMIN_PREFIX
from tokenmill.server.security import authorization

logger = logging.getLogger(__name__)

fleet_app = FastAPI(title="tokenmill fleet", docs_url=None, redoc_url=None, openapi_url=None)
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "headers")
_WATCH_INTERVAL_S = 2.0
_LIVE_STATES = ("STARTING", "UPDATING", "RECOVERING", "RUNNING", "PENDING_MIGRATION")
_ROUTER_WAIT_S = 10.0  # for the router to learn the replicas, when an admin call comes first


# Module functions the routes call come before the class: serve.ingress copies the routes (and the
# module globals they name) when it decorates the class.
def _forwarded(request_scope: Scope) -> dict[str, Any]:
    """The parts of the request's ASGI scope a replica needs (plain data: it crosses processes)."""
    scope = {k: request_scope[k] for k in _SCOPE_KEYS if k in request_scope}
    scope.update(root_path="", client=request_scope.get("client"), server=request_scope.get("server"))
    return scope


def _with_body(scope: dict[str, Any], body: bytes) -> dict[str, Any]:
    """The scope of the same request with another body (its content-length changed)."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    return scope | {"headers": [*headers, (b"content-length", str(len(body)).encode())]}


@serve.ingress(fleet_app)
class FleetIngress:
    """The ingress deployment: one replica of it (it does no model work) in front of the replicas."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self,
        replicas: DeploymentHandle[Any],
        config: ServerConfig,
        fleet: FleetConfig,
        model: str,
        prefill: DeploymentHandle[Any] | None = None,
    ) -> None:
        self.replicas = replicas.options(stream=True)
        self.prefill = prefill.options(stream=True) if prefill is not None else None
        use_serve_logging()
        self.config, self.fleet = config, fleet
        self.stats = FleetMetrics.for_model(model)
        self.door = FrontDoor(config)
        low, high = fleet.bounds
        self.stats.set_replicas(0, low, low, high)
        self._watch = asyncio.ensure_future(self._watch_replicas(replicas.deployment_name))

    @fleet_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        refused = self.door.refusal(request)
        if refused is not None:
            return refused
        return Response(self.stats.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @fleet_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def forward(self, request: Request) -> Response:
        admin = request.url.path.startswith(ADMIN_PREFIX)
        return self.door.admit(request, self._fan_out if admin else self._relay)

    async def _fan_out(self, request_scope: Scope, body: bytes) -> Response:
        if not self.fleet.prefix_router:
            message = "in fleet mode the admin API needs the prefix-aware router (not --fleet-router ray-default)."
            return JSONResponse(error_body(501, message, "not_supported"), status_code=501)
        # Every replica has its own model pool, prefill replicas too (they must serve the same models).
        targets = [(self.replicas.handle, r) for r in await self._replica_ids(("both", "decode"))]
        if self.prefill is not None:
            targets += [(self.prefill.handle, r) for r in await self._replica_ids(("prefill",))]
        return await fan_out(targets, _forwarded(request_scope), body)

    async def _replica_ids(self, roles: tuple[str, ...]) -> list[str]:
        """The replicas of these roles the routers know (they learn them from Ray Serve a moment after
        the ingress starts)."""
        deadline = asyncio.get_running_loop().time() + _ROUTER_WAIT_S
        while True:
            ids = sorted(
                {name for source in self.stats.stats_sources for name, s in source().items() if s[ROLE] in roles}
            )
            if ids or asyncio.get_running_loop().time() > deadline:
                return ids
            await asyncio.sleep(0.2)

    async def _relay(self, request_scope: Scope, body: bytes) -> Response:
        scope = _forwarded(request_scope)
        salt = authorization(scope["headers"]) if self.config.prefix_cache_isolation == "per-key" else None
        hints = hints_from_body(scope["path"], body, salt)
        routing = asdict(hints) if hints is not None else None
        if self.prefill is not None:
            await self._prefill_first(scope, body, hints)
        failure = "no replica answered"
        for attempt in range(1, self.fleet.max_attempts + 1):
            stream = cast(DeploymentResponseGenerator[Any], self.replicas.handle.remote(scope, body, routing=routing))
            try:
                first: list[dict[str, Any]] = await stream.__anext__()
            except RayActorError as exc:
                failure = f"its replica failed before answering ({type(exc).__name__})"
            else:
                if not retryable(first):
                    return Relay(first, stream)
                failure = "its replica is shutting down"
                stream.cancel()  # type: ignore[no-untyped-call]
            if attempt < self.fleet.max_attempts:
                self.stats.retries.labels(self.stats.model_name).inc()
                logger.warning("%s %s: %s; sending it to another replica", scope["method"], scope["path"], failure)
        message = f"the request could not be served: {failure} ({self.fleet.max_attempts} tries); retry later."
        return JSONResponse(error_body(503, message, "replica_unavailable"), status_code=503)

    async def _prefill_first(self, scope: dict[str, Any], body: bytes, hints: RoutingHints | None) -> None:
        """Have a prefill replica compute the prompt (and save its blocks) when it is long enough."""
        assert self.prefill is not None
        prefill = prefill_body(scope["path"], body)
        if (
            hints is None
            or prefill is None
            or not takes_prefill_hop(scope["path"], hints.prompt_tokens, self.fleet.pd_min_prompt_tokens)
        ):
            self.stats.prefill_hops.labels(self.stats.model_name, "skipped").inc()
            return
        routing = asdict(replace(hints, load_tokens=hints.prompt_tokens + 1))
        stream = cast(
            DeploymentResponseGenerator[Any],
            self.prefill.handle.remote(_with_body(scope, prefill), prefill, routing=routing),
        )
        try:
            status, answer = await collect(stream)
        except RayActorError as exc:
            status, answer = 503, f"the prefill replica failed ({type(exc).__name__})".encode()
        finally:
            stream.cancel()  # type: ignore[no-untyped-call]  # a no-op once it has ended
        if status == 200:
            self.stats.prefill_hops.labels(self.stats.model_name, "prefilled").inc()
            return
        # The decode replica answers anyway: it computes the prompt, or gives the same error for bad input.
        self.stats.prefill_hops.labels(self.stats.model_name, "failed").inc()
        log = logger.warning if status >= 500 else logger.debug
        log("the prefill hop of %s answered %d (%s); decoding without it", scope["path"], status, answer[:200])

    async def _watch_replicas(self, deployment: str) -> None:
        """Log every change of the replica count and keep tokenmill:fleet_replicas up to date."""
        app_name = serve.get_replica_context().app_name
        low, high = self.fleet.bounds
        last = None
        while True:
            try:
                status = await asyncio.to_thread(serve.status)
                info = status.applications[app_name].deployments[deployment]
            except Exception:  # the controller is busy or restarting: try again next time
                logger.debug("could not read the deployment status", exc_info=True)
            else:
                states = {str(getattr(k, "value", k)): v for k, v in info.replica_states.items()}
                current = states.get("RUNNING", 0)
                target = sum(states.get(s, 0) for s in _LIVE_STATES)
                self.stats.set_replicas(current, target, low, high)
                if (current, target) != last:
                    message = f": {info.message}" if info.message else ""
                    logger.info(
                        "fleet: %d replicas running, target %d (min %d, max %d)%s", current, target, low, high, message
                    )
                    last = (current, target)
            await asyncio.sleep(_WATCH_INTERVAL_S)
