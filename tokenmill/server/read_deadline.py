"""A deadline on reading each request's body (against slow-loris clients that trickle it in).

uvicorn bounds the idle time between requests (`timeout_keep_alive`) but not how long one request's
body may take to arrive. This ASGI middleware wraps `receive`: until the last body chunk has come,
each read may only wait until `timeout_s` after the request reached the app; past that the client
gets a 408 and the app sees `http.disconnect`. Once the body is in, `receive` is the server's own
again (no deadline: it only waits for disconnects then)."""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import error_body_for


class ReadDeadlineMiddleware:
    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False
        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        async def guarded_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:  # (TimeoutError itself only from Python 3.11)
                body_done = True  # from now on the app only hears the disconnect
                if not started:
                    await _send_408(scope, guarded_send, self.timeout_s)
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, guarded_receive, guarded_send)


async def _send_408(scope: Scope, send: Send, timeout_s: float) -> None:
    message = f"the request body did not arrive within {timeout_s:g} seconds."
    body = json.dumps(error_body_for(scope["path"], 408, message, "request_timeout")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 408, "headers": headers})
    await send({"type": "http.response.body", "body": body})
