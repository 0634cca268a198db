"""The step-time model fitted to a served engine's step counters (tokenmill/planner/step_fit.py,
tokenmill/bench/calibrate_server.py's /metrics reading)."""

from __future__ import annotations

import pytest

from tokenmill.bench.calibrate_server import read_step_counters, window_samples
from tokenmill.planner.step_fit import MIN_BASE_S, StepSample, fit_step_costs

BASE, PER_ROW, PER_TOKEN = 0.006, 0.0012, 0.0011


def sample(steps: int, rows: int, tokens: int) -> StepSample:
    """`steps` steps with `rows` decode rows and `tokens` prompt tokens in all, timed by the model above."""
    return StepSample(steps, BASE * steps + PER_ROW * rows + PER_TOKEN * tokens, rows, tokens)


def test_costs_are_recovered_from_windows_of_averaged_steps() -> None:
    samples = [sample(100, 100, 0), sample(80, 1280, 0), sample(5, 0, 1500), sample(20, 300, 4000)]
    costs = fit_step_costs(samples)
    assert costs["decode_base_s"] == pytest.approx(BASE, rel=1e-6)
    assert costs["decode_per_row_s"] == pytest.approx(PER_ROW, rel=1e-6)
    assert costs["prefill_per_token_s"] == pytest.approx(PER_TOKEN, rel=1e-6)


def test_the_fit_reproduces_the_total_busy_time_when_the_model_is_not_exact() -> None:
    # Decode steps at 16 rows ran 3 ms slower than a line through the others: no line fits all.
    samples = [sample(100, 100, 0), StepSample(50, BASE * 50 + PER_ROW * 800 + 0.15, 800, 0), sample(5, 0, 1500)]
    costs = fit_step_costs(samples)
    predicted = sum(
        costs["decode_base_s"] * s.steps
        + costs["decode_per_row_s"] * s.decode_rows
        + costs["prefill_per_token_s"] * s.prefill_tokens
        for s in samples
    )
    assert predicted == pytest.approx(sum(s.seconds for s in samples), rel=1e-9)


def test_a_cost_that_would_fit_negative_is_held_at_zero() -> None:
    # Larger batches were no slower per step: the per-row cost is 0, not below.
    samples = [StepSample(10, 0.10, 10, 0), StepSample(10, 0.099, 160, 0), sample(4, 0, 1000)]
    costs = fit_step_costs(samples)
    assert costs["decode_per_row_s"] == 0.0
    assert costs["decode_base_s"] > 0 and costs["prefill_per_token_s"] > 0


def test_a_base_that_would_fit_below_its_floor_is_held_there() -> None:
    # Steps grew faster than linearly with rows (a loaded machine): a line through them crosses zero.
    samples = [StepSample(10, 0.05, 10, 0), StepSample(10, 1.0, 40, 0), StepSample(10, 4.0, 160, 0), sample(4, 0, 1000)]
    costs = fit_step_costs(samples)
    assert costs["decode_base_s"] == MIN_BASE_S
    assert costs["decode_per_row_s"] > 0 and costs["prefill_per_token_s"] > 0


def test_one_window_of_decode_steps_cannot_separate_the_costs() -> None:
    with pytest.raises(ValueError, match="more concurrencies"):
        fit_step_costs([sample(100, 400, 0)])
    with pytest.raises(ValueError, match="no engine steps"):
        fit_step_costs([StepSample(0, 0.0, 0, 0)])


METRICS = """# HELP tokenmill:engine_step_seconds Wall time
tokenmill:engine_step_seconds_bucket{kind="decode",le="0.01",model_name="m"} 3.0
tokenmill:engine_step_seconds_count{kind="decode",model_name="m"} %d
tokenmill:engine_step_seconds_sum{kind="decode",model_name="m"} %f
tokenmill:engine_step_decode_rows_total{kind="decode",model_name="m"} %d
tokenmill:engine_step_prefill_tokens_total{kind="decode",model_name="m"} 0.0
tokenmill:engine_step_seconds_count{kind="prefill",model_name="m"} 2.0
tokenmill:engine_step_seconds_sum{kind="prefill",model_name="m"} 0.5
tokenmill:engine_step_decode_rows_total{kind="prefill",model_name="m"} 0.0
tokenmill:engine_step_prefill_tokens_total{kind="prefill",model_name="m"} 600.0
"""


def test_a_window_is_what_the_counters_grew_by_per_kind() -> None:
    before = read_step_counters(METRICS % (10, 0.1, 40))
    after = read_step_counters(METRICS % (30, 0.5, 200))
    assert window_samples(before, after) == [StepSample(20, pytest.approx(0.4), 160, 0)]  # prefill did not grow


def test_a_server_without_step_metrics_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="engine_step"):
        read_step_counters("vllm:num_requests_running 0\n")
