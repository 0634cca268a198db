"""The dashboard's arithmetic, by hand: histogram quantiles as Prometheus computes them, bucket deltas,
the error types a response maps to, and the memory bandwidth the step loop draws (panel 7)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tokenmill.metrics.bandwidth import BandwidthGauges, load_measured_bandwidth, save_measured_bandwidth
from tokenmill.server.dashboard.errors import error_type
from tokenmill.server.dashboard.samples import bucket_delta, per_bucket, quantile

INF = math.inf
BUCKETS = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]  # cumulative: 10 <= 0.1 s, 20 more <= 0.5 s, ...


def test_quantile_interpolates_inside_the_bucket_like_histogram_quantile() -> None:
    assert quantile(0.25, BUCKETS) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert quantile(0.5, BUCKETS) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)  # rank 20, halfway in (0.1, 0.5]
    assert quantile(0.99, BUCKETS) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)


def test_quantile_in_the_inf_bucket_answers_the_largest_finite_bound() -> None:
    assert quantile(0.99, [(0.1, 1.0), (INF, 100.0)]) == 0.1


def test_quantile_of_nothing_is_none() -> None:
    assert quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None
    assert quantile(0.5, []) is None


def test_bucket_delta_and_per_bucket_counts() -> None:
    later = [(0.1, 12.0), (0.5, 35.0), (1.0, 47.0), (INF, 48.0)]
    assert bucket_delta(later, BUCKETS) == [(0.1, 2.0), (0.5, 5.0), (1.0, 7.0), (INF, 8.0)]
    assert per_bucket(BUCKETS) == [(0.1, 10.0), (0.5, 20.0), (1.0, 10.0), (INF, 0.0)]


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (200, None, None),
        (499, "client_closed", None),
        (400, "invalid_request", "validation"),
        (404, "model_not_found", "validation"),
        (413, "request_too_large", "validation"),
        (401, "invalid_api_key", "unauthorized"),
        (429, "queue_full", "queue_full"),
        (429, "rate_limit_exceeded", "rate_limited"),
        (504, "request_timeout", "timeout"),
        (408, None, "timeout"),
        (503, "memory_pressure", "out_of_memory"),
        (500, "engine_error", "engine_error"),
        (503, "engine_dead", "engine_error"),
    ],
)
def test_error_types(status: int, code: str | None, kind: str | None) -> None:
    assert error_type(status, code) == kind


def test_bandwidth_draw_is_the_bytes_read_per_second_against_the_measured_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = CollectorRegistry()
    gauges = BandwidthGauges(registry, "m", peak_gb_s=20.0)
    clock = iter([100.0, 100.5])
    monkeypatch.setattr("tokenmill.metrics.bandwidth.time.monotonic", lambda: next(clock))
    gauges.sample(1e9)
    gauges.sample(1e9 + 4e9)  # 4 GB in half a second
    value = registry.get_sample_value
    assert value("tokenmill:memory_bandwidth_bytes_per_s", {"model_name": "m"}) == 8e9
    assert value("tokenmill:memory_bandwidth_peak_bytes_per_s", {"model_name": "m"}) == 20e9
    assert value("tokenmill:memory_bandwidth_utilization", {"model_name": "m"}) == pytest.approx(0.4)


def test_without_a_measured_peak_there_is_no_utilization_series() -> None:
    registry = CollectorRegistry()
    BandwidthGauges(registry, "m", peak_gb_s=None).sample(5e9)
    assert registry.get_sample_value("tokenmill:memory_bandwidth_utilization", {"model_name": "m"}) is None
    assert registry.get_sample_value("tokenmill:memory_bandwidth_bytes_per_s", {"model_name": "m"}) == 0.0


def test_info_bandwidth_measurement_is_kept_for_later_servers(tmp_path: Path) -> None:
    path = tmp_path / "memory_bandwidth.json"
    assert load_measured_bandwidth(path) is None
    save_measured_bandwidth(17.5, path)
    assert load_measured_bandwidth(path) == 17.5
    path.write_text("not json")
    assert load_measured_bandwidth(path) is None
