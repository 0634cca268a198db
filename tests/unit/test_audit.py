"""The audit log takes any input (a lone surrogate from a JSON escape included), keeps request bodies
only with --audit-log-content, and writes a line per admin API call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from tokenmill.server.audit import AuditLog, AuditMiddleware, note_model

BODY = json.dumps({"model": "m@2", "prompt": "secret " * 1000}).encode()


class _Recorder(AuditLog):
    def __init__(self, content: bool) -> None:  # no file: keeps what would be written
        self.content = content
        self.written: list[tuple[dict[str, Any], bytes]] = []

    def write(self, fields: dict[str, Any], body: bytes = b"") -> None:
        self.written.append((fields, body))


async def _route(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the body as a route does, names its model, and answers 404."""
    message = await receive()
    note_model(scope, json.loads(message["body"])["model"])
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def _call(audit: AuditLog, path: str, method: str = "POST") -> None:
    scope = {"type": "http", "path": path, "method": method, "headers": [], "client": ("10.1.2.3", 5000)}
    sent = [{"type": "http.request", "body": BODY, "more_body": False}]

    async def receive() -> Message:
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    async def send(_: Message) -> None:
        pass

    asyncio.run(AuditMiddleware(_route, audit, "tiny", admin_prefix="/admin/")(scope, receive, send))


def test_a_lone_surrogate_is_written_as_its_json_escape(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path))
    audit.write({"model": json.loads('"\\ud800x"')})
    audit.write({"model": "after"})
    audit.close()
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines == [{"model": "\ud800x"}, {"model": "after"}]


def test_without_content_the_body_is_not_kept_but_the_model_is_written() -> None:
    audit = _Recorder(content=False)
    _call(audit, "/v1/completions")
    ((fields, body),) = audit.written
    assert body == b""
    assert fields["model"] == "m@2" and fields["status"] == 404 and fields["client"] == "10.1.2.3"


def test_with_content_the_body_is_kept() -> None:
    audit = _Recorder(content=True)
    _call(audit, "/v1/chat/completions")
    ((_, body),) = audit.written
    assert body == BODY


def test_admin_calls_are_audited_with_their_method_and_target() -> None:
    audit = _Recorder(content=False)
    _call(audit, "/admin/models/load")
    _call(audit, "/admin/aliases/stable", method="PUT")
    _call(audit, "/v1/files")  # not an audited route
    routes = [(f["method"], f["route"], f["model"]) for f, _ in audit.written]
    assert routes == [("POST", "/admin/models/load", "m@2"), ("PUT", "/admin/aliases/stable", "m@2")]
