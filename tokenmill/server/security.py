"""API keys (compared in constant time) and per-key rate limits (requests/min, tokens/min).

Each limit is a token bucket holding one minute's budget that refills continuously, so a key may
burst up to its per-minute limit and then runs at the limit's rate. A request is charged its
prompt tokens plus its max_tokens (times n) when admitted; what it did not generate is refunded
when it ends. Responses carry OpenAI's `x-ratelimit-*` headers."""

from __future__ import annotations

import hmac
import math
import time
from dataclasses import dataclass, field

from tokenmill.server.errors import APIError

ANONYMOUS = "anonymous"


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in dict.fromkeys(k.strip() for k in keys) if k]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None) -> str:
        """The caller's key name (for rate limits); raises a 401 APIError without a valid key."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(
                401,
                "missing API key: send the header 'Authorization: Bearer YOUR_KEY'.",
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        candidate = given.strip().encode()
        match = -1
        for i, key in enumerate(self._keys):  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(key, candidate):
                match = i
        if match < 0:
            raise APIError(401, "invalid API key.", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return f"key-{match}"


@dataclass
class _Bucket:
    capacity: float
    level: float
    updated: float

    @property
    def rate(self) -> float:  # per second
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        return max(0.0, (amount - self.level) / self.rate)

    def reset_in(self) -> float:
        return (self.capacity - self.level) / self.rate


@dataclass
class Admission:
    key: str
    num_tokens: int
    headers: dict[str, str] = field(default_factory=dict)


class RateLimiter:
    def __init__(self, requests_per_min: int | None = None, tokens_per_min: int | None = None) -> None:
        for name, value in (("requests_per_min", requests_per_min), ("tokens_per_min", tokens_per_min)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset for no limit), got {value}.")
        self.requests_per_min = requests_per_min
        self.tokens_per_min = tokens_per_min
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def _bucket(self, key: str, kind: str, capacity: int, now: float) -> _Bucket:
        bucket = self._buckets.get((key, kind))
        if bucket is None:
            bucket = self._buckets[(key, kind)] = _Bucket(float(capacity), float(capacity), now)
        bucket.refill(now)
        return bucket

    def acquire(self, key: str, num_tokens: int) -> Admission:
        """Charge one request and `num_tokens` to `key`, or raise a 429 APIError with Retry-After."""
        now = time.monotonic()
        limits = [
            (kind, cap, amount)
            for kind, cap, amount in (
                ("requests", self.requests_per_min, 1),
                ("tokens", self.tokens_per_min, num_tokens),
            )
            if cap is not None
        ]
        buckets = [(kind, self._bucket(key, kind, cap, now), amount) for kind, cap, amount in limits]
        for kind, bucket, amount in buckets:
            if amount > bucket.capacity:
                raise APIError(
                    400,
                    f"this request needs {amount} {kind} but the limit is "
                    f"{int(bucket.capacity)} {kind} per minute; lower max_tokens or n.",
                    "request_exceeds_rate_limit",
                )
        wait = max((b.wait_for(a) for _, b, a in buckets), default=0.0)
        if wait > 0:
            headers = self._headers(buckets)
            headers["Retry-After"] = str(max(1, math.ceil(wait)))
            raise APIError(
                429,
                f"rate limit reached for this API key; retry in {wait:.1f} s.",
                "rate_limit_exceeded",
                headers=headers,
            )
        for _, bucket, amount in buckets:
            bucket.level -= amount
        return Admission(key, num_tokens, self._headers(buckets))

    def refund(self, key: str, num_tokens: int) -> None:
        """Give back tokens a request reserved but did not use."""
        bucket = self._buckets.get((key, "tokens"))
        if bucket is not None and num_tokens > 0:
            bucket.refill(time.monotonic())
            bucket.level = min(bucket.capacity, bucket.level + num_tokens)

    @staticmethod
    def _headers(buckets: list[tuple[str, _Bucket, int]]) -> dict[str, str]:
        headers: dict[str, str] = {}
        for kind, bucket, _ in buckets:
            headers[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(bucket.level)))
            headers[f"x-ratelimit-reset-{kind}"] = f"{bucket.reset_in():.3f}s"
        return headers
