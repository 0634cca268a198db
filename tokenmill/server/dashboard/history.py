"""The dashboard's memory: once a second, read the server's Prometheus registry and keep one point of
derived figures (rates, percentiles, breakdowns) for the last ten minutes.

Everything comes from the registry that /metrics renders, so the page and Prometheus agree."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from tokenmill.server.dashboard.samples import Samples, bucket_delta, quantile

INTERVAL_S = 1.0
HISTORY_S = 600
WINDOW_S = 60  # percentiles, cost and the recent baseline look back this far
P = "tokenmill:"
LATENCIES = {
    "ttft": f"{P}time_to_first_token_seconds",
    "itl": f"{P}inter_token_latency_seconds",
    "e2e": f"{P}e2e_request_latency_seconds",
    "queue": f"{P}request_queue_time_seconds",
}
REPLICA_STATES = ("current", "target", "min", "max")


@dataclass(frozen=True)
class _Read:
    time: float  # unix seconds
    samples: Samples


class History:
    def __init__(self, registry: CollectorRegistry, throughput_baseline: float | None = None) -> None:
        self.registry = registry
        self.configured_baseline = throughput_baseline
        self.points: deque[dict[str, Any]] = deque(maxlen=int(HISTORY_S / INTERVAL_S))
        self.scaling_events: deque[dict[str, Any]] = deque(maxlen=50)
        self._reads: deque[_Read] = deque(maxlen=int(WINDOW_S / INTERVAL_S) + 1)

    def window_tokens_per_s(self) -> float:
        """Total (prompt + generated) tokens/s over the last minute of reads."""
        if len(self._reads) < 2:
            return 0.0
        first, last = self._reads[0], self._reads[-1]
        return _tokens(last.samples, first.samples) / max(last.time - first.time, 1e-9)

    def sample(self) -> dict[str, Any]:
        """Read the registry now and append a point (the caller refreshes sampled gauges first)."""
        now = Samples(self.registry)
        read = _Read(time.time(), now)
        prev = self._reads[-1] if self._reads else None
        self._reads.append(read)
        oldest = self._reads[0]
        dt = max(read.time - prev.time, 1e-9) if prev else 1.0
        before = prev.samples if prev else None
        point: dict[str, Any] = {"t": round(read.time, 3)}
        point["prefill_tps"] = _rate(now, before, f"{P}prompt_tokens_total", dt)
        point["decode_tps"] = _rate(now, before, f"{P}generation_tokens_total", dt)
        point["tokens_per_s"] = point["prefill_tps"] + point["decode_tps"]
        point["tokens_per_s_1m"] = self.window_tokens_per_s()
        point["baseline"] = self._baseline(point["tokens_per_s_1m"])
        point["utilization"] = point["tokens_per_s_1m"] / point["baseline"] if point["baseline"] else 0.0
        routes = now.by(f"{P}route_tokens_total", "route")
        routes_before = before.by(f"{P}route_tokens_total", "route") if before else {}
        point["routes_tps"] = {r: max(0.0, v - routes_before.get(r, 0.0)) / dt for r, v in routes.items()}
        batches = now.total(f"{P}batch_size_count") - (before.total(f"{P}batch_size_count") if before else 0.0)
        seqs = now.total(f"{P}batch_size_sum") - (before.total(f"{P}batch_size_sum") if before else 0.0)
        point["batch_size_mean"] = seqs / batches if batches > 0 else 0.0
        point["running"] = now.total(f"{P}num_requests_running")
        point["waiting"] = now.total(f"{P}num_requests_waiting")
        point["kv_blocks"] = now.by(f"{P}kv_cache_blocks", "state")
        point["kv_usage"] = now.total(f"{P}kv_cache_usage_perc")
        # The second KV tier (--kv-offloading-size): blocks held, of its capacity, and prompt tokens/s it serves.
        point["kv_tier_blocks"] = now.total(f"{P}kv_tier_blocks")
        point["kv_tier_capacity_blocks"] = now.total(f"{P}kv_tier_capacity_blocks")
        point["kv_tier_hit_tps"] = _rate(now, before, f"{P}kv_tier_hit_tokens_total", dt)
        point["rss_bytes"] = now.by(f"{P}process_resident_memory_bytes", "process")
        point["cpu_busy_cores"] = now.by(f"{P}cpu_busy_cores", "process")
        point["gpu_utilization"] = now.total(f"{P}gpu_utilization_perc")
        point["gpu_memory_bytes"] = now.total(f"{P}gpu_memory_used_bytes")
        point["memory_bandwidth_bytes_per_s"] = now.total(f"{P}memory_bandwidth_bytes_per_s")
        point["memory_bandwidth_peak_bytes_per_s"] = now.total(f"{P}memory_bandwidth_peak_bytes_per_s")
        for key, name in LATENCIES.items():
            window = bucket_delta(now.buckets(name), oldest.samples.buckets(name))
            for q in (0.5, 0.9, 0.99):
                point[f"{key}_p{round(q * 100)}"] = quantile(q, window)
        errors = now.by(f"{P}request_errors_total", "type")
        errors_before = before.by(f"{P}request_errors_total", "type") if before else errors
        point["errors_per_s"] = {k: max(0.0, v - errors_before.get(k, 0.0)) / dt for k, v in errors.items()}
        point["replicas"] = self._replicas(now, read.time)
        point["cost_per_million"] = now.total(f"{P}cost_per_million_tokens_dollars")
        self.points.append(point)
        return point

    def since(self, t: float) -> list[dict[str, Any]]:
        return [p for p in self.points if p["t"] > t]

    def _baseline(self, tokens_per_s_1m: float) -> float:
        """The configured figure, else the best one-minute throughput seen in the history."""
        if self.configured_baseline is not None:
            return self.configured_baseline
        best = max((p["tokens_per_s_1m"] for p in self.points), default=0.0)
        return max(best, tokens_per_s_1m)

    def _replicas(self, now: Samples, t: float) -> dict[str, float]:
        # tokenmill:fleet_replicas is set by the Ray fleet; a single server is one replica of one.
        found = now.by(f"{P}fleet_replicas", "state")
        replicas = {s: found.get(s, 1.0) for s in REPLICA_STATES} if found else dict.fromkeys(REPLICA_STATES, 1.0)
        last = self.points[-1]["replicas"] if self.points else None
        if last is not None and (last["current"], last["target"]) != (replicas["current"], replicas["target"]):
            self.scaling_events.append({"t": round(t, 3), "from": last["current"], **replicas})
        return replicas


def _rate(now: Samples, before: Samples | None, name: str, dt: float) -> float:
    if before is None:
        return 0.0
    return max(0.0, now.total(name) - before.total(name)) / dt


def _tokens(now: Samples, before: Samples) -> float:
    names = (f"{P}prompt_tokens_total", f"{P}generation_tokens_total")
    return max(0.0, sum(now.total(n) - before.total(n) for n in names))
