"""When online traffic (anything but the Batch API's idle class) was last seen, and whether it is still
"recent": the Batch API runs one line at a time then (server/batch_runner.py) and the scheduler keeps the
idle class's steps short, so an arriving online request never waits behind a long batch step.

Recent means within ONLINE_QUIET_S, or QUIET_GAPS times the median pause between its recent bursts when
that is longer: a silence that long means the traffic stopped, not that its next request is late. At 2
requests/s (median pause ~0.35 s) a fixed 2 s window ends by chance before ~2% of arrivals, which then
met whole-prompt batch steps (~100 ms on 2 cores); 10 median pauses, ~3.5 s, before ~0.1%."""

from __future__ import annotations

import math
import statistics
from collections import deque

ONLINE_QUIET_S = 2.0  # the shortest silence that ends "recent"
QUIET_GAPS = 10  # ... or this many median pauses between bursts, when longer
MAX_QUIET_S = 30.0  # never longer: a batch gets the whole machine within this after online traffic ends
MIN_PAUSE_S = 0.05  # shorter pauses lie between the steps of one burst, not between arrivals
NUM_PAUSES = 32  # pauses remembered


class OnlineTraffic:
    def __init__(self) -> None:
        self.last_seen = -math.inf
        self._pauses: deque[float] = deque(maxlen=NUM_PAUSES)

    def seen(self, now: float) -> None:
        """Online traffic is live at `now` (a step ran it, or a request of it waits)."""
        pause = now - self.last_seen
        if MIN_PAUSE_S < pause < math.inf:
            self._pauses.append(pause)
        self.last_seen = now

    @property
    def quiet_after_s(self) -> float:
        """How long a silence ends "recent"."""
        if not self._pauses:
            return ONLINE_QUIET_S
        return min(MAX_QUIET_S, max(ONLINE_QUIET_S, QUIET_GAPS * statistics.median(self._pauses)))

    def recent(self, now: float) -> bool:
        return now - self.last_seen < self.quiet_after_s
