"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, for every response under
/v1/messages (the route's own, request validation's, and the auth and body-limit middlewares'), so that
the anthropic SDK raises its matching exception (BadRequestError, AuthenticationError, ...)."""

from __future__ import annotations

from typing import Any

MESSAGES_PREFIX = "/v1/messages"

# Anthropic's error types by status; other 4xx are invalid_request_error, other 5xx api_error.
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    fallback = "api_error" if status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": _TYPES.get(status, fallback), "message": message}}
