"""Counts every error response by type (tokenmill:request_errors_total) and keeps the last few for the
dashboard: time, type, status, route and model only, never a prompt or an output.

An ASGI middleware outside the API-key check, so 401s and 429s are seen as well. Errors inside a
stream that has already started (status 200) are not seen here."""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.metrics.operations import OperationsMetrics

_ERROR_BODY_LIMIT = 4096  # error bodies are small JSON; past this the code is not looked for


def error_type(status: int, code: str | None) -> str | None:
    """The dashboard's error type for a response, or None for a success (or a client that left)."""
    if status < 400 or status == 499:
        return None
    if status == 429:
        return "queue_full" if code == "queue_full" else "rate_limited"
    if status in (401, 403):
        return "unauthorized"
    if status in (408, 504):
        return "timeout"
    if code in ("memory_pressure", "out_of_memory"):
        return "out_of_memory"
    if status >= 500:
        return "engine_error"
    return "validation"


class ErrorTracker:
    def __init__(self, ops: OperationsMetrics, model_name: str, keep: int = 50) -> None:
        self.ops, self.model_name = ops, model_name
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)

    def record(self, status: int, code: str | None, route: str) -> None:
        kind = error_type(status, code)
        if kind is None:
            return
        self.ops.count_error(kind)
        entry = {"time": round(time.time(), 3), "type": kind, "status": status, "route": route}
        self.recent.append({**entry, "model": self.model_name})


class ErrorTrackerMiddleware:
    def __init__(self, app: ASGIApp, tracker: ErrorTracker) -> None:
        self.app, self.tracker = app, tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, body = 0, bytearray()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and status >= 400:
                if len(body) < _ERROR_BODY_LIMIT:
                    body.extend(message.get("body", b"")[:_ERROR_BODY_LIMIT])
                if not message.get("more_body", False):
                    self.tracker.record(status, _code(bytes(body)), scope["path"][:100])
            await send(message)

        await self.app(scope, receive, watch)


def _code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None
