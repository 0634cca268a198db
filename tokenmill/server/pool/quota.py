"""How many model loads each API key may start per hour (--model-loads-per-hour). A load starts an engine
(a process of its own, its weights and KV cache) and reads every file of the model: far more work than a
request, so a key asking for model after model is refused before the next load, not after."""

from __future__ import annotations

import math
import time
from collections import deque

from tokenmill.server.errors import APIError

WINDOW_S = 3600.0


class LoadQuota:
    """At most `per_hour` loads per key in any hour (a sliding window); None: no limit."""

    def __init__(self, per_hour: int | None) -> None:
        self.per_hour = per_hour
        self._started: dict[str, deque[float]] = {}

    def charge(self, key: str) -> None:
        """Count one load for `key`, or raise a 429 APIError (Retry-After) if its hour's loads are spent."""
        if self.per_hour is None:
            return
        now = time.monotonic()
        started = self._started.setdefault(key, deque())
        while started and now - started[0] >= WINDOW_S:
            started.popleft()
        if len(started) >= self.per_hour:
            wait = max(1, math.ceil(started[0] + WINDOW_S - now))
            raise APIError(
                429,
                f"this API key has started {self.per_hour} model loads in the last hour (the server's "
                f"--model-loads-per-hour); use a loaded model (GET /v1/models shows their state) or retry in {wait} s.",
                "model_load_quota_exceeded",
                "model",
                headers={"Retry-After": str(wait)},
            )
        started.append(now)
