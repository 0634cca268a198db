"""The memory bandwidth the step loop draws, against what this machine can move.

The draw is the rate of tokenmill:engine_step_bytes_read (an estimate from the step's shape: weights once
per forward, plus the KV cache attention reads). The machine's figure is the one `tokenmill info
--bandwidth` measured last (a best-of-5 float32 copy), kept in tokenmill's cache; without it the
utilization fraction is not exported.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from tokenmill.loader.default_model import cache_dir

MEASURED_FILE = "memory_bandwidth.json"


def measured_path() -> Path:
    return cache_dir() / MEASURED_FILE


def save_measured_bandwidth(gb_s: float, path: Path | None = None) -> None:
    """Remember a measurement (`tokenmill info --bandwidth`) for the servers started later."""
    path = path or measured_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"memory_bandwidth_gb_s": gb_s, "measured_at": time.time()}) + "\n")


def load_measured_bandwidth(path: Path | None = None) -> float | None:
    """GB/s from the last `tokenmill info --bandwidth`, or None when there is none (or it is unreadable)."""
    try:
        value = json.loads((path or measured_path()).read_text())["memory_bandwidth_gb_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


class BandwidthGauges:
    """tokenmill:memory_bandwidth_bytes_per_s (the draw over the last sample) and, once a peak has been
    measured, tokenmill:memory_bandwidth_peak_bytes_per_s and tokenmill:memory_bandwidth_utilization (draw
    over peak). All three are registered either way, so dashboards can name them."""

    def __init__(self, registry: CollectorRegistry, model_name: str, peak_gb_s: float | None) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenmill:{name}", doc, ["model_name"], registry=registry)

        self.draw = gauge(
            "memory_bandwidth_bytes_per_s", "Memory bandwidth the step loop draws (estimated), over the last second."
        ).labels(model_name)
        peak = gauge(
            "memory_bandwidth_peak_bytes_per_s", "This machine's memory bandwidth (tokenmill info --bandwidth)."
        )
        utilization = gauge(
            "memory_bandwidth_utilization", "The step loop's memory-bandwidth draw over the measured peak (0-1)."
        )
        self.peak_bytes = peak_gb_s * 1e9 if peak_gb_s is not None else None
        self.utilization: Gauge | None = None
        if self.peak_bytes is not None:
            peak.labels(model_name).set(self.peak_bytes)
            self.utilization = utilization.labels(model_name)
        self._last: tuple[float, float] | None = None  # (monotonic time, bytes read so far)

    def sample(self, bytes_read_total: float) -> None:
        now = time.monotonic()
        if self._last is not None and now > self._last[0]:
            rate = max(0.0, bytes_read_total - self._last[1]) / (now - self._last[0])
            self.draw.set(rate)
            if self.utilization is not None and self.peak_bytes:
                self.utilization.set(rate / self.peak_bytes)
        self._last = (now, bytes_read_total)
