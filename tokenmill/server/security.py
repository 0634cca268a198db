"""API keys (compared in constant time), per-key rate limits (requests/min, tokens/min), and a
throttle on failed logins per client address.

Each limit is a token bucket holding one minute's budget that refills continuously, so a key may
burst up to its per-minute limit and then runs at the limit's rate. A request is charged its
prompt tokens plus its max_tokens (times n) when admitted; what it did not generate is refunded
when it ends. A request refused as invalid (400) is charged one request: validating it (tokenizing
its prompt) costs work too. Responses carry OpenAI's `x-ratelimit-*` headers."""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tokenmill.server.errors import APIError

ANONYMOUS = "anonymous"


def request_key(scope: Mapping[str, Any]) -> str:
    """The name of the key a request came with (AuthMiddleware puts it in the ASGI scope)."""
    return str(scope.get("tokenmill_key", ANONYMOUS))


class ApiKeys:
    def __init__(self, keys: list[str], priority_keys: list[str] | tuple[str, ...] = ()) -> None:
        unique = [k for k in dict.fromkeys(k.strip() for k in keys) if k]
        self._keys = [k.encode() for k in unique]
        wanted = {k.strip() for k in priority_keys if k.strip()}
        unknown = wanted - set(unique)
        if unknown:
            raise ValueError(f"{len(unknown)} of the --priority-keys are not among the API keys (--api-key).")
        self._priority_names = frozenset(f"key-{i}" for i, k in enumerate(unique) if k in wanted)

    def honours_priority(self, name: str) -> bool:
        """Whether requests from the key named `name` (from `identify`) may set `priority`."""
        return name in self._priority_names

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
                "missing API key: send the header 'Authorization: Bearer YOUR_KEY' (or 'x-api-key: YOUR_KEY').",
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
        buckets = self._available(key, num_tokens)
        for _, bucket, amount in buckets:
            bucket.level -= amount
        return Admission(key, num_tokens, self._headers(buckets))

    @contextmanager
    def charging_refusals(self, key: str) -> Iterator[None]:
        """Around a request's validation and admission: a 429 before any work once `key` has no request
        left, and one request charged when the request is refused (400), so that a flood of invalid
        requests is throttled like a flood of valid ones. An admitted request is charged by `acquire`."""
        self._available(key, 0)
        try:
            yield
        except APIError as exc:
            if exc.status == 400 and self.requests_per_min is not None:
                bucket = self._bucket(key, "requests", self.requests_per_min, time.monotonic())
                bucket.level -= 1  # below zero after a concurrent flood: every one of them was served
            raise

    def _available(self, key: str, num_tokens: int) -> list[tuple[str, _Bucket, int]]:
        """The buckets one request and `num_tokens` would be charged to; a 429 APIError if they cannot be."""
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
        return buckets

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


class LoginThrottle:
    """After `max_failures` failed logins (401s) from one client address within `window_s`, that
    address is locked: answered 429 with Retry-After until the oldest of them leaves the window.
    Failures count per address, so a guesser cannot spread guesses over keys; but a key that already
    logged in from that address keeps working while it is locked, so that behind a shared address
    (NAT, a reverse proxy) one client's bad keys do not lock out the others. A new key, right or
    wrong, is refused unread while the address is locked: a guess cannot tell a right key."""

    MAX_TRACKED = 10_000  # addresses with failures, and (address, key) pairs that logged in

    def __init__(self, max_failures: int = 10, window_s: float = 60.0) -> None:
        if max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {max_failures}.")
        self.max_failures, self.window_s = max_failures, window_s
        self._failures: dict[str, deque[float]] = {}
        self._known: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # least recently used first
        self._salt = secrets.token_bytes(16)  # the remembered keys' hashes mean nothing outside this process

    def key_hash(self, authorization: str | None) -> bytes:
        return hashlib.blake2b((authorization or "").encode(), key=self._salt, digest_size=16).digest()

    def _recent(self, address: str, now: float) -> deque[float] | None:
        times = self._failures.get(address)
        if times is None:
            return None
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        return times

    def check(self, address: str, key_hash: bytes | None = None) -> None:
        """Raise a 429 APIError with Retry-After if `address` has failed too often lately, unless
        `key_hash` (from `key_hash`) has logged in from there before."""
        now = time.monotonic()
        times = self._recent(address, now)
        if times is None or len(times) < self.max_failures:
            return
        if key_hash is not None and (address, key_hash) in self._known:
            self._known.move_to_end((address, key_hash))
            return
        wait = times[0] + self.window_s - now
        raise APIError(
            429,
            f"too many failed logins from this address; retry in {wait:.0f} s.",
            "too_many_failed_logins",
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
        )

    def failed(self, address: str) -> None:
        now = time.monotonic()
        if len(self._failures) >= self.MAX_TRACKED:
            for stale in [a for a, t in self._failures.items() if not t or t[-1] <= now - self.window_s]:
                del self._failures[stale]
        times = self._recent(address, now)
        if times is None:
            times = self._failures[address] = deque(maxlen=self.max_failures)
        times.append(now)

    def succeeded(self, address: str, key_hash: bytes) -> None:
        self._known[(address, key_hash)] = None
        self._known.move_to_end((address, key_hash))
        if len(self._known) > self.MAX_TRACKED:
            self._known.popitem(last=False)


def authenticate(keys: ApiKeys, throttle: LoginThrottle, address: str, authorization: str | None) -> str:
    """The caller's key name (see `ApiKeys.identify`), through the failed-login throttle: a 429
    APIError while `address` is locked (unless this key logged in from there before), a 401 for a
    missing or wrong key (counted against `address`). Without keys, every caller is ANONYMOUS.
    The one key check of the server's routes, its admin API and the fleet's ingress."""
    if not keys.enabled:
        return ANONYMOUS
    key_hash = throttle.key_hash(authorization)
    throttle.check(address, key_hash)  # before the key is read, so a locked address learns nothing
    try:
        name = keys.identify(authorization)
    except APIError:
        throttle.failed(address)
        raise
    throttle.succeeded(address, key_hash)
    return name


def authorization(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The Authorization header of raw ASGI headers. Anthropic's clients send `x-api-key: KEY`,
    OpenAI's `Authorization: Bearer KEY`: the same keys, so the first counts as the second."""
    found = {k.lower(): v.decode("latin-1") for k, v in headers if k.lower() in (b"authorization", b"x-api-key")}
    if b"authorization" in found:
        return found[b"authorization"]
    return f"Bearer {found[b'x-api-key']}" if b"x-api-key" in found else None


def client_address(scope: Mapping[str, Any]) -> str:
    """The client's address: the peer, or what X-Forwarded-For says when the peer is one of
    --forwarded-allow-ips (uvicorn resolves that before the app sees the scope)."""
    client = scope.get("client")
    return str(client[0]) if client else ""
