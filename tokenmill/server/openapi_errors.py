"""The error answers a route declares in the OpenAPI schema (so clients and the schema fuzz know every
status a route may send): one table, with a route's own wording where it differs."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tokenmill.server.protocol import ErrorResponse

Responses = dict[int | str, dict[str, Any]]

_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request",
    401: "Missing or wrong API key",
    404: "Unknown model",
    408: "Body not received in time",
    413: "Body too large",
    429: "Rate limit or full queue (see Retry-After)",
    500: "Engine failure",
    503: "Shutting down, engine restarting or dead",
    504: "Past its deadline (request_timeout, max_queue_time)",
}


def error_responses(model: type[BaseModel] = ErrorResponse, **wording: str) -> Responses:
    """Every error status with `model` as its body; `wording` overrides a status's description, given
    as e.g. `s404="No such file"`."""
    described = {**_DESCRIPTIONS, **{int(k.removeprefix("s")): v for k, v in wording.items()}}
    return {code: {"model": model, "description": desc} for code, desc in described.items()}


def streamed(errors: Responses, events: str = "server-sent events") -> Responses:
    """`errors` and a 200 that is JSON, or with stream=true a stream of `events`."""
    return {**errors, 200: {"content": {"text/event-stream": {}}, "description": f"JSON, or with stream=true {events}"}}


ROUTE_ERRORS = error_responses()
