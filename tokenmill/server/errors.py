"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the right status codes.

Handlers raise `APIError`; the app turns it (and FastAPI's own validation and routing errors) into a
JSON response here; under /v1/messages in Anthropic's shape instead (anthropic_errors.py). Internal
failures get a stable message: the details go to the server log only."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.server.anthropic_errors import anthropic_error_body, is_anthropic_path

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request; it has been logged."
ENGINE_FAILED_MESSAGE = "The engine failed while generating this request; it has been logged."

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout",  # a request past its deadline (--request-timeout, --max-queue-time)
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def error_body_for(
    path: str, status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The error body in the shape of the API that `path` belongs to: Anthropic's under /v1/messages."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, code, param)


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> JSONResponse:
    return JSONResponse(error_body_for(path, status, message, code, param), status_code=status, headers=headers)


def sse_error(status: int, message: str, code: str | None = None) -> str:
    """An error as a streamed chunk (a stream that has started cannot change its status code)."""
    return f"data: {json.dumps(error_body(status, message, code))}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request body is invalid.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON.", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    where = f" at {param}" if param else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{first.get('msg', 'invalid value')}{where}{more}.", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request", param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = {404: "no such route; see /docs for the API.", 405: "method not allowed on this route."}.get(
            status, str(exc.detail)
        )
        return error_response(status, message, None, None, dict(exc.headers or {}), request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request handler", exc_info=exc)
        return error_response(500, INTERNAL_ERROR_MESSAGE, "internal_error", path=request.url.path)
