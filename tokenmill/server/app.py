"""The FastAPI app: OpenAI routes, health and readiness, Prometheus metrics, and the ASGI middleware
that bounds body sizes and checks API keys before any route runs.

    state = ServerState.create(ServerConfig(), AsyncEngine(EngineArgs()))
    app = build_app(state)  # serve with uvicorn; the engine loop starts with the app

Both middlewares are plain ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection
pass straight through."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tokenmill
from tokenmill.server import batches, embeddings, messages, responses
from tokenmill.server.audit import AuditLog, AuditMiddleware, note_model
from tokenmill.server.chat import create_chat_completion
from tokenmill.server.completions import create_completion
from tokenmill.server.config import ServerState
from tokenmill.server.dashboard import DASHBOARD_PAGE, DASHBOARD_STATIC, Dashboard
from tokenmill.server.dashboard.errors import ErrorTrackerMiddleware
from tokenmill.server.errors import APIError, error_body, error_body_for, install_error_handlers
from tokenmill.server.files import UPLOAD_PATH, upload_body_limit
from tokenmill.server.health import engine_trouble
from tokenmill.server.hosts import HostMiddleware, allowed_hosts
from tokenmill.server.lora_routes import LORA_ROUTES, lora_router
from tokenmill.server.openapi_errors import ROUTE_ERRORS, streamed
from tokenmill.server.pool.admin import ADMIN_PREFIX, admin_router
from tokenmill.server.pool.listing import model_cards
from tokenmill.server.pool.pool import state_for_model
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from tokenmill.server.read_deadline import ReadDeadlineMiddleware
from tokenmill.server.security import authenticate, authorization, client_address, request_key

logger = logging.getLogger(__name__)

# The dashboard's page and files hold no data (its data route needs a key); browsers ask for /favicon.ico.
_PUBLIC_PATHS = frozenset({"/health", "/ready", "/favicon.ico", DASHBOARD_PAGE})
_PUBLIC_PREFIXES = (DASHBOARD_STATIC,)


def is_public(path: str, metrics_public: bool) -> bool:
    """Whether any client may reach `path` without a key: health, readiness, the dashboard's page and
    files (they hold no data; the page sends its key for the data), and /metrics with --metrics-public."""
    return path in _PUBLIC_PATHS or path.startswith(_PUBLIC_PREFIXES) or (metrics_public and path == "/metrics")


THROUGHPUT_LOG_INTERVAL_S = 10.0


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        task = asyncio.ensure_future(_log_throughput(state))
        sampler = asyncio.ensure_future(dashboard.run())
        if state.models is not None:
            state.models.start()
        try:
            yield
        finally:
            task.cancel()
            sampler.cancel()
            if state.models is not None:
                await state.models.close()
            state.engine.abort_all()
            await asyncio.to_thread(state.engine.shutdown)
            await asyncio.to_thread(dashboard.close)
            if audit is not None:
                await asyncio.to_thread(audit.close)  # writes every line still queued

    app = FastAPI(
        title="tokenmill",
        version=tokenmill.__version__,
        lifespan=lifespan,
        description="An OpenAI-compatible server for the tokenmill engine.",
    )
    app.state.server = state
    audit = AuditLog(state.config.audit_log, state.config.audit_log_content) if state.config.audit_log else None
    app.state.audit = audit
    install_error_handlers(app)
    dashboard = Dashboard(state)  # its sampler also feeds /metrics' process, cost and error figures
    if state.config.dashboard:
        app.include_router(dashboard.router)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=streamed(ROUTE_ERRORS))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        note_model(request.scope, body.model)
        async with state_for_model(state, body.model, request_key(request.scope)) as target:
            return await create_completion(target, body, request, request_key(request.scope))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=streamed(ROUTE_ERRORS))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        note_model(request.scope, body.model)
        async with state_for_model(state, body.model, request_key(request.scope)) as target:
            return await create_chat_completion(target, body, request, request_key(request.scope))

    # The other API families (Responses, Anthropic Messages, embeddings, files and batches): one router each.
    app.include_router(batches.router(state))
    app.include_router(messages.router(state))
    app.include_router(responses.router(state))
    app.include_router(embeddings.router(state))
    if state.loras is not None:  # runtime adapter loads (vLLM's routes)
        app.include_router(lora_router(state, state.loras, state.config.models.resolved_admin_key()))

    @app.get("/v1/models", response_model=ModelList, responses={401: ROUTE_ERRORS[401]})
    async def models(request: Request) -> Any:
        if state.models is not None:  # as JSON: the cards' extra fields (version, aliases, state) stay
            cards = model_cards(state.models, request_key(request.scope))
            return JSONResponse({"object": "list", "data": [card.model_dump() for card in cards]})
        # The served name only: the model's path on this machine is no client's business.
        card = ModelCard(id=state.model_name, root=state.model_name, max_model_len=state.engine.max_model_len)
        loras = state.loras
        adapters = (
            [
                ModelCard(id=name, root=name, parent=state.model_name, created=loras.created.get(name, 0))
                for name in loras.by_name
            ]
            if loras is not None
            else []
        )
        return ModelList(data=[card, *adapters])

    @app.get("/health", responses={503: ROUTE_ERRORS[503]})
    async def health() -> Response:
        """Liveness: 503 while a new engine starts after one died, once the engine is dead for good,
        or while a step has stalled. Public, so it never says why (the log and the dashboard do)."""
        trouble = engine_trouble(state.engine)
        if trouble is not None:
            return JSONResponse(error_body(503, trouble.message, trouble.code), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        """No icon: answered so that a browser's own request is not a 404 on the dashboard's errors."""
        return Response(status_code=204)

    @app.get("/ready", responses={503: ROUTE_ERRORS[503]})
    async def ready() -> Response:
        """Readiness: the model is loaded and new requests are accepted. Not while a new engine
        starts (requests sent meanwhile wait for it, but a balancer should send them elsewhere)."""
        try:
            state.check_accepting()
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=503)
        if state.engine.restarting is not None:
            return JSONResponse(error_body(503, "the engine is restarting.", "engine_restarting"), status_code=503)
        return JSONResponse({"status": "ready", "model": state.model_name})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        page = state.models.metrics.render() if state.models is not None else state.metrics.render()
        return Response(page, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenmill.__version__}

    if state.models is not None:
        app.include_router(admin_router(state.models, state.config.models.resolved_admin_key(), state.throttle))

    # The last added runs first: keys are checked before any body is read.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=state.config.max_body_bytes,
        upload_bytes=upload_body_limit(state),
    )
    if state.config.body_read_timeout_s is not None:  # bounds the body limit's read of the body
        app.add_middleware(ReadDeadlineMiddleware, timeout_s=state.config.body_read_timeout_s)
    app.add_middleware(AuthMiddleware, state=state)
    # Outside auth and the body limit, so that their 401s, 429s and 413s are counted too.
    app.add_middleware(ErrorTrackerMiddleware, tracker=dashboard.errors)
    if audit is not None:  # outside auth and the body limit, so that their 401s, 429s and 413s are written too
        app.add_middleware(AuditMiddleware, audit=audit, model_name=state.model_name, admin_prefix=ADMIN_PREFIX)
    if state.config.allowed_origins:  # outside auth: preflights carry no key, and 401s need CORS headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
        )
    hosts = allowed_hosts(state.config.host, state.config.allowed_hosts)
    app.add_middleware(HostMiddleware, allowed=hosts)
    return app


async def _log_throughput(state: ServerState) -> None:
    while True:
        await asyncio.sleep(THROUGHPUT_LOG_INTERVAL_S)
        state.metrics.log_throughput()
        if state.models is not None:
            state.models.log_throughput()


async def _send_error(
    scope: Scope, send: Send, status: int, message: str, code: str, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(error_body_for(scope["path"], status, message, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """Every route but the public ones needs a valid key; the key's name goes into the scope."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state
        # With an admin key, the LoRA adapter routes check it themselves (lora_routes.py).
        self.own_key_paths = LORA_ROUTES if state.config.models.resolved_admin_key() is not None else ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The admin routes check the admin key themselves.
        path = scope["path"] if scope["type"] == "http" else ""
        if (
            not path
            or path.startswith(ADMIN_PREFIX)
            or path in self.own_key_paths
            or is_public(path, self.state.config.metrics_public)
        ):
            return await self.app(scope, receive, send)
        try:
            address = client_address(scope)
            scope["tokenmill_key"] = authenticate(
                self.state.keys, self.state.throttle, address, authorization(scope["headers"])
            )
        except APIError as exc:
            return await _send_error(scope, send, exc.status, exc.message, exc.code or "", exc.headers)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the request body (up to `max_bytes`, else 413) before the app sees it, then replays it;
    later `receive()` calls go to the server, so disconnects are still seen."""

    def __init__(self, app: ASGIApp, max_bytes: int, upload_bytes: int) -> None:
        self.app, self.max_bytes, self.upload_bytes = app, max_bytes, upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # File uploads (the Batch API's input) have their own, larger limit.
        upload = scope["path"] == UPLOAD_PATH and scope["method"] == "POST"
        max_bytes = self.upload_bytes if upload else self.max_bytes
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        too_large = f"the request body is larger than this server's limit of {max_bytes} bytes."
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            return await _send_error(
                scope,
                send,
                413 if length.isdigit() else 400,
                too_large if length.isdigit() else "bad Content-Length.",
                "request_too_large",
            )
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                return await _send_error(scope, send, 413, too_large, "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
