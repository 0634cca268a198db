"""When the front end may start a new engine after one died.

Each death gets a few tries with doubling back-off (a start can fail for a passing reason: memory
not yet returned by the dead process, a busy disk). Deaths themselves are capped per window: an
engine that keeps dying (a broken device, a fault the requeue guard does not catch) ends up dead and
visible on /health, instead of restarting forever while every request fails."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    max_restarts: int = 5  # engine deaths restarted within `window_s`; 0 turns restarts off
    window_s: float = 600.0
    attempts: int = 3  # tries to start a new engine after one death
    first_delay_s: float = 0.5  # before the first try; doubles with each failed try
    _deaths: collections.deque[float] = field(default_factory=collections.deque)

    def allow(self, now: float | None = None) -> bool:
        """Record a death; True if a restart is allowed for it."""
        now = time.monotonic() if now is None else now
        while self._deaths and now - self._deaths[0] > self.window_s:
            self._deaths.popleft()
        if len(self._deaths) >= self.max_restarts:
            return False
        self._deaths.append(now)
        return True

    def delays(self) -> list[float]:
        """The wait before each try to start a new engine."""
        return [self.first_delay_s * 2**i for i in range(self.attempts)]
