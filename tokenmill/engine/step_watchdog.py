"""When the engine counts as hung: requests are in flight and no step has finished for too long.

A step that never returns (a collective waiting on a rank that hangs, a kernel that spins, a device
that blocks instead of failing) leaves the engine alive, so nothing reports a death and, with no
request timeout, its clients wait forever. The front end hears from the engine after every step, so
silence past the step timeout means one step has run that long; the front end then kills the engine
and starts a new one exactly as after a death (async_engine.py).

The timeout, unless set: max(60 s, 20 x the 99th percentile of the recent steps' times). The floor
covers a long first step on a slow machine (a large prefill on a CPU) before any
step was measured; the margin keeps a slow but healthy step (a burst of long prompts) far from it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

FLOOR_S = 60.0
MARGIN = 20.0
# Steps remembered for the percentile: recent enough to follow a change of load, enough for a p99.
RECENT_STEPS = 1024


@dataclass
class StepWatchdog:
    timeout_s: float | None = None  # None: derived from the measured step times; 0 or less: never hung
    _recent: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=RECENT_STEPS))

    def record(self, step_seconds: float) -> None:
        """A model step's time (0: a report without a model step, not measured)."""
        if step_seconds > 0:
            self._recent.append(step_seconds)

    @property
    def enabled(self) -> bool:
        return self.timeout_s is None or self.timeout_s > 0

    def limit(self) -> float:
        """The current step timeout in seconds."""
        if self.timeout_s is not None:
            return self.timeout_s
        if not self._recent:
            return FLOOR_S
        times = sorted(self._recent)
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        return max(FLOOR_S, MARGIN * p99)

    def check_interval(self) -> float:
        """How often to look: often enough to act within a quarter of the timeout, at most every second."""
        return min(1.0, self.limit() / 4)

    def is_hung(self, silent_s: float) -> bool:
        """True if the engine has had requests in flight and stayed silent for `silent_s` seconds too long."""
        return self.enabled and silent_s > self.limit()
