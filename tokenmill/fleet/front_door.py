"""What the fleet's ingress checks before it buffers a request: first the caller's key, from the headers
alone and through the failed-login throttle (the server's own `authenticate`), then the body, read under
the server's body cap and arrival deadline (its own BodyLimitMiddleware and ReadDeadlineMiddleware, so
the limits and the 413 and 408 answers are the same). A caller without a key never gets its body read.

The replicas check keys again; the ingress's check is the one that counts failures for the whole fleet
(each replica has its own throttle, and would allow a guesser that many more tries)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.app import BodyLimitMiddleware, is_public
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError, error_response
from tokenmill.server.files import upload_bytes_limit
from tokenmill.server.pool.admin import ADMIN_PREFIX, check_admin_key
from tokenmill.server.read_deadline import ReadDeadlineMiddleware
from tokenmill.server.security import ApiKeys, LoginThrottle, authenticate, authorization, client_address

# What the ingress does with a request once its body is in: (scope, body) -> the response.
BodyHandler = Callable[[Scope, bytes], Awaitable[Response]]


class FrontDoor:
    """The ingress's key check and body reader, for one server configuration."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.keys = ApiKeys(config.keys(), ())
        admin_key = config.models.resolved_admin_key()
        self.admin_keys = ApiKeys([admin_key] if admin_key else [], ())
        self.throttle = LoginThrottle(config.max_failed_logins)

    def admit(self, request: Request, handler: BodyHandler) -> Response:
        """The answer to `request`: the key check's error, else a response that reads the body under
        the server's limits (their 413 or 408), else `handler(scope, body)`'s."""
        refused = self.refusal(request)
        return refused if refused is not None else self.reading_body(handler)

    def refusal(self, request: Request) -> Response | None:
        """The error the server would answer (401, or 429 while the address is throttled) unless the
        request may go on: a public path, a valid API key, or on /admin/... the admin key."""
        path = request.scope["path"]
        if is_public(path, self.config.metrics_public) or self._preflight(request):
            return None
        try:
            if path.startswith(ADMIN_PREFIX):
                check_admin_key(self.admin_keys, self.throttle, request.scope)
            elif self.keys.enabled:
                address = client_address(request.scope)
                authenticate(self.keys, self.throttle, address, authorization(request.headers.raw))
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers, path)
        return None

    def _preflight(self, request: Request) -> bool:
        """A CORS preflight carries no key: the replica's CORS middleware answers it, as the server's does."""
        return (
            bool(self.config.allowed_origins)
            and request.method == "OPTIONS"
            and "access-control-request-method" in request.headers
        )

    def reading_body(self, handler: BodyHandler) -> Response:
        """A response that reads the request's body under the server's limits, then answers with
        `handler(scope, body)`."""

        async def with_body(scope: Scope, receive: Receive, send: Send) -> None:
            message = await receive()  # the body limit replays the whole body as one message
            response = await handler(scope, message.get("body", b""))
            await response(scope, receive, send)

        app: ASGIApp = BodyLimitMiddleware(
            with_body, max_bytes=self.config.max_body_bytes, upload_bytes=upload_bytes_limit(self.config)
        )
        if self.config.body_read_timeout_s is not None:
            app = ReadDeadlineMiddleware(app, timeout_s=self.config.body_read_timeout_s)
        return AsgiResponse(app)


class AsgiResponse(Response):
    """A route's answer that is an ASGI app: it gets the request's own `receive` (the body not read yet)."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__()
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
