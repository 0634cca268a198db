"""Which Host names the server answers (`--allowed-hosts`): the guard against DNS rebinding.

A web page can point a name it controls at 127.0.0.1 and then script requests to a key-less server on
this machine; the browser sends that name as the Host header. So a server bound to loopback answers
only loopback names (localhost, 127.0.0.1, [::1], with any port) unless `--allowed-hosts` says
otherwise; a server bound beyond loopback without `--allowed-hosts` answers any name (the launcher
warns). Other Hosts get 400 in OpenAI's error shape.

Entries are names or addresses (case-insensitive, port ignored), `*.example.com` for a domain's
subdomains, or `*` for any."""

from __future__ import annotations

import ipaddress
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.errors import error_body_for

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether binding to `host` serves this machine only."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, configured: tuple[str, ...]) -> tuple[str, ...] | None:
    """The Host names to accept; None: any."""
    if configured:
        return None if "*" in configured else tuple(_normalize(h) for h in configured)
    if is_loopback(bind_host):
        return tuple(dict.fromkeys((*LOOPBACK_NAMES, _normalize(bind_host))))
    return None


def _normalize(host: str) -> str:
    """A Host header's or an entry's name: lowercase, without port, brackets or a trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1] or [::1]:8000
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def host_allowed(header: str, allowed: tuple[str, ...]) -> bool:
    name = _normalize(header)
    if not name:
        return False
    return any(name == entry or (entry.startswith("*.") and name.endswith(entry[1:])) for entry in allowed)


class HostMiddleware:
    """Answers 400 to a request whose Host header is not one of `allowed` (None: lets every one in)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...] | None) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed is None or scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
        if host_allowed(header, self.allowed):
            return await self.app(scope, receive, send)
        message = (
            f"the Host {header[:100]!r} is not allowed on this server (see tokenmill serve --allowed-hosts)."
            if header
            else "the request has no Host header."
        )
        body = json.dumps(error_body_for(scope["path"], 400, message, "invalid_host")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if scope["type"] == "websocket":  # refuse the handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 400, "headers": headers})
        await send({"type": "http.response.body", "body": body})
