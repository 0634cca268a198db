"""A request's length limits, resolved once for the offline API and the server alike: the prompt's
length, and max_tokens (its default, from the context the prompt leaves, and its caps)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.scheduling.scheduler import AdmissionLimits


class RequestRejected(ValueError):
    """A request outside the limits: a ValueError for the offline API; `code` and `param` name the
    error for an HTTP API (the server's 400 error object)."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class RequestCaps:
    """What a caller lets one request ask for, within what the engine can run (the server's
    --max-tokens-limit and --max-prompt-tokens); None: only the engine's limits. `default_max_tokens`
    is max_tokens for a request that gives none (None: as many as the context leaves room for)."""

    max_tokens: int | None = None
    max_prompt_tokens: int | None = None
    default_max_tokens: int | None = None


NO_CAPS = RequestCaps()


def resolve_max_tokens(
    limits: AdmissionLimits, num_prompt_tokens: int, requested: int | None, caps: RequestCaps = NO_CAPS
) -> int:
    """The request's max_tokens: `requested`, checked against the caps, or when None the default within
    the caps and the context left after the prompt. RequestRejected when the prompt or max_tokens is
    over a cap, or when prompt + max_tokens could never run (limits.check)."""
    max_len = limits.max_model_len
    _check_prompt_cap(num_prompt_tokens, caps)
    cap = min(caps.max_tokens or max_len, max_len)
    if requested is None:
        room = max_len - num_prompt_tokens
        max_tokens = max(1, min(cap, room, caps.default_max_tokens or room))
    elif caps.max_tokens is not None and requested > cap:
        raise RequestRejected(
            f"max_tokens is {requested}; this server allows at most {cap}.", "max_tokens_too_large", "max_tokens"
        )
    else:
        max_tokens = requested
    try:
        limits.check(num_prompt_tokens, max_tokens)
    except ValueError as exc:
        raise RequestRejected(str(exc), "invalid_request") from exc
    return max_tokens


def check_pooling_prompt(limits: AdmissionLimits, num_prompt_tokens: int, caps: RequestCaps = NO_CAPS) -> None:
    """A pooling request's prompt (it generates nothing): within the caps and the engine's limits, else
    RequestRejected."""
    _check_prompt_cap(num_prompt_tokens, caps)
    if num_prompt_tokens > limits.max_model_len:
        raise RequestRejected(
            f"the input has {num_prompt_tokens} tokens, more than the model's context ({limits.max_model_len}).",
            "input_too_long",
            "input",
        )
    try:
        limits.check(num_prompt_tokens, 0)
    except ValueError as exc:
        raise RequestRejected(str(exc), "invalid_request", "input") from exc


def _check_prompt_cap(num_prompt_tokens: int, caps: RequestCaps) -> None:
    if caps.max_prompt_tokens is not None and num_prompt_tokens > caps.max_prompt_tokens:
        raise RequestRejected(
            f"the prompt has {num_prompt_tokens} tokens; this server accepts at most {caps.max_prompt_tokens}.",
            "prompt_too_long",
            "prompt",
        )
