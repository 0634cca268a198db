"""The second KV tier's counters on their way out: cumulative in each step snapshot, exported to
Prometheus as counters of what grew, and gauges of the blocks held (nothing moves without a tier), and
on the live dashboard's memory panel."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill.engine.messages import EngineSnapshot
from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.metrics.prometheus import ServerMetrics
from tokenmill.server.dashboard.history import History

MODEL = "tiny"
BASE = EngineSnapshot(1, 0, 0, 0.5, 10, 0, 0, 0, 4, 1)


def _sample(metrics: ServerMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(f"tokenmill:{name}", {"model_name": MODEL})


def test_tier_counters_follow_the_cumulative_snapshots() -> None:
    metrics = ServerMetrics(MODEL)
    first = KVTierStats(capacity_blocks=100, num_blocks=10, hit_tokens=32, blocks_loaded=2, bytes_read=2048)
    second = dataclasses.replace(first, num_blocks=12, hit_tokens=80, blocks_loaded=5, load_failures=1, loads=2)
    metrics.on_step(dataclasses.replace(BASE, kv_tier=first))
    metrics.on_step(dataclasses.replace(BASE, kv_tier=second))
    assert _sample(metrics, "kv_tier_hit_tokens_total") == 80
    assert _sample(metrics, "kv_tier_blocks_loaded_total") == 5
    assert _sample(metrics, "kv_tier_load_failures_total") == 1
    assert _sample(metrics, "kv_tier_bytes_read_total") == 2048
    assert _sample(metrics, "kv_tier_blocks") == 12 and _sample(metrics, "kv_tier_capacity_blocks") == 100


def test_without_a_tier_its_metrics_stay_at_zero() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(BASE)
    assert _sample(metrics, "kv_tier_hit_tokens_total") == 0 and _sample(metrics, "kv_tier_blocks") == 0


def test_the_live_dashboard_plots_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = ServerMetrics(MODEL)
    history = History(metrics.registry)
    clock = iter([1000.0, 1002.0])
    monkeypatch.setattr("tokenmill.server.dashboard.history.time.time", lambda: next(clock))
    stats = KVTierStats(capacity_blocks=100, num_blocks=10, hit_tokens=32)
    metrics.on_step(dataclasses.replace(BASE, kv_tier=stats))
    history.sample()
    metrics.on_step(dataclasses.replace(BASE, kv_tier=dataclasses.replace(stats, num_blocks=14, hit_tokens=96)))
    point = history.sample()
    assert point["kv_tier_hit_tps"] == 32.0  # 64 tokens in 2 s
    assert (point["kv_tier_blocks"], point["kv_tier_capacity_blocks"]) == (14, 100)
