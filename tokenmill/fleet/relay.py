"""Relaying a replica's ASGI messages from the ingress to the client."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response
from ray.exceptions import RayActorError
from starlette.types import Receive, Scope, Send

from tokenmill.server.errors import sse_error

logger = logging.getLogger(__name__)

_RETRY_CODES = frozenset({"shutting_down", "engine_dead"})  # a replica's 503s that another replica may not give


class Relay(Response):
    """Sends a replica's ASGI messages on as they arrive; ends a failed stream with an error."""

    def __init__(self, first: list[dict[str, Any]], rest: Any) -> None:
        super().__init__()
        self.first, self.rest = first, rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = next((m for m in self.first if m["type"] == "http.response.start"), None)
        streaming = start is not None and any(
            k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.get("headers", [])
        )
        finished = False
        try:
            async for batch in _batches(self.first, self.rest):
                for message in batch:
                    await send(message)
                    finished = message["type"] == "http.response.body" and not message.get("more_body", False)
        except RayActorError as exc:
            logger.warning("a replica failed mid-response (%s); ending the response with an error", exc)
            error = sse_error(503, "the replica serving this request failed; retry.", "replica_failed")
            await send(
                {"type": "http.response.body", "body": (error + "data: [DONE]\n\n").encode() if streaming else b""}
            )
        finally:
            if not finished:
                self.rest.cancel()  # the client left (or we failed): the replica aborts the request


async def _batches(first: list[dict[str, Any]], rest: Any) -> AsyncIterator[list[dict[str, Any]]]:
    yield first
    async for batch in rest:
        yield batch


def retryable(first: list[dict[str, Any]]) -> bool:
    """A 503 from a replica that is going away (draining, or its engine dead for good)."""
    start = first[0] if first and first[0]["type"] == "http.response.start" else None
    if start is None or start["status"] != 503:
        return False
    body = b"".join(m.get("body", b"") for m in first if m["type"] == "http.response.body")
    try:
        return json.loads(body)["error"]["code"] in _RETRY_CODES
    except (ValueError, KeyError, TypeError):
        return False
