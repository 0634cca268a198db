"""The fleet ingress's front door, without Ray: the key is checked from the headers before any byte of
the body is read, the body is read under the server's cap (413) and arrival deadline (408), failed keys
are throttled per address (429), and an admin call's combined answer reports every replica."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Message, Scope

from tokenmill.fleet.admin import ReplicaAnswer, combined
from tokenmill.fleet.front_door import FrontDoor
from tokenmill.server.config import PoolConfig, ServerConfig
from tokenmill.server.dashboard import DASHBOARD_PAGE, DASHBOARD_STATIC
from tokenmill.server.errors import error_body

KEY, ADMIN = "sk-user", "sk-admin"


def front_app(**settings: Any) -> FastAPI:
    """The ingress's routes over a FrontDoor; the handler echoes the body's length."""
    config = ServerConfig(api_keys=(KEY,), models=PoolConfig(admin_key=ADMIN), **settings)
    door = FrontDoor(config)
    app = FastAPI()

    async def echo(scope: Scope, body: bytes) -> Response:
        return JSONResponse({"path": scope["path"], "length": len(body)})

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(request: Request) -> Response:
        return door.admit(request, echo)

    return app


class Call:
    """One request through an ASGI app, its body sent in `chunks` (`delay_s` before each); records how
    many chunks the app read."""

    def __init__(self, chunks: Sequence[bytes], delay_s: float = 0.0) -> None:
        self.chunks, self.delay_s, self.read = list(chunks), delay_s, 0
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        if self.read >= len(self.chunks):
            await asyncio.sleep(3600)  # a client that keeps the connection open
        await asyncio.sleep(self.delay_s)
        self.read += 1
        return {"type": "http.request", "body": self.chunks[self.read - 1], "more_body": self.read < len(self.chunks)}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def run(self, app: FastAPI, path: str, headers: dict[str, str], method: str = "POST") -> tuple[int, Any]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "client": ("10.0.0.7", 5000),
            "server": ("127.0.0.1", 8000),
        }
        asyncio.run(asyncio.wait_for(app(scope, self.receive, self.send), 10))
        status = next(m["status"] for m in self.sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        return status, json.loads(body)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read() -> None:
    app = front_app()
    for headers in ({}, bearer("sk-wrong")):
        call = Call([b"x" * 1024] * 1000)
        status, body = call.run(app, "/v1/completions", headers)
        assert (status, body["error"]["code"], call.read) == (401, "invalid_api_key", 0)


def test_a_request_with_its_key_gets_its_whole_body_handled() -> None:
    status, body = Call([b"ab", b"cd", b"e"]).run(front_app(), "/v1/completions", bearer(KEY))
    assert (status, body) == (200, {"path": "/v1/completions", "length": 5})


def test_a_body_over_the_cap_is_refused_with_the_servers_413() -> None:
    app = front_app(max_body_bytes=100)
    call = Call([b"x" * 60] * 50)  # no Content-Length: read until the cap
    status, body = call.run(app, "/v1/completions", bearer(KEY))
    assert (status, body["error"]["code"]) == (413, "request_too_large") and call.read == 2
    announced = Call([b"x"])
    status, body = announced.run(app, "/v1/completions", bearer(KEY) | {"content-length": "101"})
    assert (status, body["error"]["code"], announced.read) == (413, "request_too_large", 0)


def test_a_body_that_does_not_arrive_in_time_gets_the_servers_408() -> None:
    call = Call([b"x"] * 100, delay_s=0.05)  # 5 s of trickle against a 0.3 s deadline
    status, body = call.run(front_app(body_read_timeout_s=0.3), "/v1/completions", bearer(KEY))
    assert (status, body["error"]["code"]) == (408, "request_timeout") and call.read < 10


def test_failed_keys_lock_the_address_out_but_not_a_key_that_logged_in_from_there() -> None:
    app = front_app(max_failed_logins=3)
    assert Call([b"{}"]).run(app, "/v1/completions", bearer(KEY))[0] == 200
    statuses = [Call([b"{}"]).run(app, "/v1/completions", bearer(f"guess-{i}"))[0] for i in range(5)]
    assert statuses == [401, 401, 401, 429, 429]
    assert Call([b"{}"]).run(app, "/v1/completions", bearer(KEY))[0] == 200


def test_admin_paths_take_the_admin_key_and_public_paths_none() -> None:
    app = front_app()
    status, body = Call([b"{}"]).run(app, "/admin/models/load", bearer(KEY))
    assert (status, body["error"]["code"]) == (401, "invalid_admin_key")  # as the replica's own admin check says
    assert Call([b"{}"]).run(app, "/admin/models/load", bearer(ADMIN))[0] == 200
    assert Call([b""]).run(app, "/health", {}, method="GET")[0] == 200


def test_the_dashboards_page_and_files_need_no_key_as_on_the_server() -> None:
    app = front_app()
    for path in (DASHBOARD_PAGE, f"{DASHBOARD_STATIC}dashboard.js"):
        assert Call([b""]).run(app, path, {}, method="GET")[0] == 200
    assert Call([b""]).run(app, "/v1/models", {}, method="GET")[0] == 401


def answer(replica: str, status: int, message: str = "") -> ReplicaAnswer:
    body = error_body(status, message, "some_code") if status >= 400 else {"id": "m@1"}
    return ReplicaAnswer(replica, status, body)


def test_an_admin_call_that_every_replica_did_answers_200_with_each_answer() -> None:
    response = combined([answer("a", 200), answer("b", 200)])
    body = json.loads(response.body)
    assert response.status_code == 200
    assert body["replicas"] == [{"replica": r, "status": 200, "body": {"id": "m@1"}} for r in ("a", "b")]


def test_an_admin_call_every_replica_refused_alike_keeps_their_status_and_error() -> None:
    response = combined([answer("a", 404, "no model x"), answer("b", 404, "no model x")])
    body = json.loads(response.body)
    assert response.status_code == 404 and body["error"]["message"] == "no model x" and len(body["replicas"]) == 2


def test_an_admin_call_that_failed_on_one_replica_is_a_502_naming_it() -> None:
    response = combined([answer("a", 200), answer("b", 503, "the replica failed")])
    body = json.loads(response.body)
    assert response.status_code == 502 and body["error"]["code"] == "partial_failure"
    assert "1 of 2 replicas failed: b: 503 the replica failed" in body["error"]["message"]
    assert [r["status"] for r in body["replicas"]] == [200, 503]
