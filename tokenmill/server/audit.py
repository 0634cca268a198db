"""`--audit-log FILE`: one JSON line per finished completion or chat request, errors and aborts included,
and per admin API call (load, unload, alias moves: `route` says which, `model` names the target).

    {"time": "2026-11-25T21:30:00.123+00:00", "key": "9f86d081884c", "client": "127.0.0.1",
     "method": "POST", "route": "/v1/chat/completions", "model": "tiny-chat", "status": 200,
     "prompt_tokens": 12, "output_tokens": 8, "latency_s": 0.412, "finish_reason": "stop"}

`key` is the first 12 hex digits of the SHA-256 of the bearer token ("-" without one), never the
token itself. Prompts and outputs (`"prompt"`, `"output"`) are written only with
--audit-log-content; only then is the request body kept. The middleware only times the request and
takes note of what the routes hand over (the job and the requested model, via the scope); the JSON
is built and written on a writer thread (a QueueListener), so a slow disk never blocks the event
loop, and every queued line is written before `close` returns. Any text is written: what UTF-8
cannot encode (a lone surrogate from a JSON escape) is written as its JSON escape.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import time
from datetime import datetime, timezone
from logging.handlers import QueueListener
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.security import authorization, client_address

if TYPE_CHECKING:
    from tokenmill.server.job import Job

AUDITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
SCOPE_KEY = "tokenmill_audit"  # the request's AuditRecord, for the routes to fill in
KEY_HASH_CHARS = 12


def key_id(authorization: str | None) -> str:
    """A short, stable id for the bearer token in an Authorization header; "-" without one."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return "-"
    return hashlib.sha256(token.encode()).hexdigest()[:KEY_HASH_CHARS]


class AuditRecord:
    """What one request's line is made of; the routes attach their job with `attach_job`."""

    __slots__ = ("body", "job", "model")

    def __init__(self) -> None:
        self.job: Job | None = None
        self.model: str | None = None  # as the request named it, for lines without a job
        self.body: list[bytes] = []  # only with --audit-log-content


def attach_job(scope: Scope, job: Job) -> None:
    """Hand a request's job to the audit middleware (a no-op without --audit-log)."""
    record = scope.get(SCOPE_KEY)
    if record is not None:
        record.job = job


def note_model(scope: Scope, model: object) -> None:
    """Hand the model a request names (once its body is parsed) to the audit middleware."""
    record = scope.get(SCOPE_KEY)
    if record is not None and isinstance(model, str):
        record.model = model


def job_fields(job: Job, content: bool) -> dict[str, Any]:
    """Token counts, finish reason (and with `content`, the outputs) of a job, however it ended."""
    outputs = [o for out in job.outputs.values() for o in out.outputs]
    expected = sum(p.params.n for p in job.prepared)
    reasons = {o.finish_reason for o in outputs if o.finish_reason is not None}
    if len(reasons) == 0 or len(outputs) < expected or any(o.finish_reason is None for o in outputs):
        reasons.add("abort")  # cut short: a client gone, an error
    fields: dict[str, Any] = {
        "model": job.model_name,
        "prompt_tokens": job.num_prompt_tokens,
        "output_tokens": job.num_generated_tokens,
        "finish_reason": ",".join(sorted(reasons)),  # one reason per kind, e.g. "length" or "length,stop"
    }
    if content:
        fields["output"] = [o.text for o in outputs]
    return fields


class _JsonLineHandler(logging.FileHandler):
    """Appends each record's dict as one JSON line (on the listener's thread); flushes every line."""

    def __init__(self, path: str, content: bool) -> None:
        # A lone surrogate (JSON lets a string hold one) cannot be UTF-8: written as backslash-u-dXXX,
        # which is that character's own JSON escape, so the line stays valid JSON and faithful.
        super().__init__(path, mode="a", encoding="utf-8", delay=False, errors="backslashreplace")
        self.content = content

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = dict(record.audit)  # type: ignore[attr-defined]
        if self.content:
            parsed = _parse(record.body)  # type: ignore[attr-defined]
            entry["prompt"] = parsed.get("messages", parsed.get("prompt"))
            entry.setdefault("output", None)
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


def _parse(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body) if body else {}
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


class AuditLog:
    """The audit file: `write` queues a line (never blocks); `close` writes what is queued and closes it."""

    def __init__(self, path: str, content: bool = False) -> None:
        self.path, self.content = path, content
        self._handler = _JsonLineHandler(path, content)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._listener = QueueListener(self._queue, self._handler)
        self._listener.start()
        self._closed = False

    def write(self, fields: dict[str, Any], body: bytes = b"") -> None:
        record = logging.makeLogRecord({"msg": "", "audit": fields, "body": body})
        if self._closed:  # a request that ended after shutdown: write it here rather than lose it
            self._handler.handle(record)
        else:
            self._queue.put_nowait(record)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._listener.stop()  # writes everything queued before it returns
        self._handler.close()


class AuditMiddleware:
    """Times each completion and chat request (and each call under `admin_prefix`) and writes its line
    once its response has ended."""

    def __init__(self, app: ASGIApp, audit: AuditLog, model_name: str, admin_prefix: str) -> None:
        self.app, self.audit, self.model_name, self.admin_prefix = app, audit, model_name, admin_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path not in AUDITED_PATHS and not (path and path.startswith(self.admin_prefix)):
            return await self.app(scope, receive, send)
        start = time.monotonic()
        record = AuditRecord()
        scope[SCOPE_KEY] = record
        status: int | None = None

        async def audited_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and self.audit.content:
                record.body.append(message.get("body", b""))
            return message

        async def audited_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, audited_receive, audited_send)
        except BaseException:
            status = status or 500  # the error handler outside answers 500 (or the client is gone)
            raise
        finally:
            self._write(scope, record, status, time.monotonic() - start)

    def _write(self, scope: Scope, record: AuditRecord, status: int | None, latency: float) -> None:
        fields: dict[str, Any] = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "key": key_id(authorization(scope["headers"])),
            "client": client_address(scope) or None,
            "method": scope["method"],
            "route": scope["path"],
            "model": self.model_name if record.job is not None else record.model,
            "status": status if status is not None else 499,  # no response at all: the client left
            "prompt_tokens": None,
            "output_tokens": None,
            "latency_s": round(latency, 6),
            "finish_reason": None,
        }
        if record.job is not None:
            fields.update(job_fields(record.job, self.audit.content))
        self.audit.write(fields, b"".join(record.body))
