"""Start-up phases and their times, so a slow start says where its seconds went.

`tokenmill serve` logs each phase as it ends (`start-up: tokenizer 0.30 s`) and a summary once it answers
(`start-up: ready in 2.1 s (config 0.05 s · ...)`); the engine process records its own phases and sends them
in its EngineReady, and the server logs them as `engine ...` phases. Each line is one log record, with the
phase's name and seconds as record attributes, so `--log-format json` gives one JSON object per phase
(log_format.py). A leaf module (standard library only): the engine and the server both use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

logger = logging.getLogger("tokenmill.startup")


class StartupPhases:
    """Phases in the order they ended. With `level` None it only records (the engine process sends its
    phases to the server, which logs them); else each phase is logged at `level` as it ends."""

    def __init__(self, level: int | None = logging.INFO) -> None:
        self.level = level
        self.started = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def since_process_start(self, name: str) -> None:
        """Record the time from this process's start to now as phase `name` (Python's start-up and the
        imports before the first phase), and count the total from there. Linux only; elsewhere a no-op."""
        age = _process_age_s()
        if age is not None:
            self.started = time.perf_counter() - age
            self.record(name, age)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (recorded only if the block returns)."""
        start = time.perf_counter()
        yield
        self.record(name, time.perf_counter() - start)

    def record(self, name: str, seconds: float) -> None:
        self.phases.append((name, seconds))
        if self.level is not None:
            logger.log(
                self.level, "start-up: %s %.2f s", name, seconds, extra={"phase": name, "seconds": round(seconds, 3)}
            )

    def ready(self) -> float:
        """Log the summary of every phase and return the seconds since the start."""
        total = time.perf_counter() - self.started
        if self.level is not None:
            summary = " · ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases)
            logger.log(
                self.level,
                "start-up: ready in %.1f s (%s)",
                total,
                summary,
                extra={"phase": "ready", "seconds": round(total, 3)},
            )
        return total


def _process_age_s() -> float | None:
    """Seconds since this process started, from /proc (to the kernel's clock tick, 10 ms)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            return float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
