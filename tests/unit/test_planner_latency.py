"""The planner's latency side: the scheduler simulation against hand-computed timelines, the SLO bisection,
and `tokenmill plan --profile` end to end on a written calibration file."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.planner.latency import meets, plan_latency, saturation_rate
from tokenmill.planner.simulate import arrivals, percentile, simulate
from tokenmill.planner.step_model import StepCosts, load_profile


def costs(
    base: float = 1.0, per_row: float = 0.0, per_token: float = 0.1, seqs: int = 8, budget: int = 64
) -> StepCosts:
    return StepCosts(base, per_row, per_token, max_num_seqs=seqs, max_num_batched_tokens=budget)


def test_one_request_timeline_is_hand_computed() -> None:
    # prefill step: 1 + 0.1 x 10 = 2 s -> first token at 2; two decode steps of 1 s -> last token at 4.
    r = simulate(costs(), [(10, 3)], math.inf)
    assert r.ttft_p50_ms == pytest.approx(2000)
    assert r.tpot_p50_ms == pytest.approx(1000)  # (4 - 2) / (3 - 1)
    assert r.duration_s == pytest.approx(4)
    assert r.output_tok_s == pytest.approx(3 / 4)
    assert r.total_tok_s == pytest.approx(13 / 4)


def test_a_long_prompt_is_chunked_by_the_token_budget() -> None:
    # budget 4: chunks 4, 4, 2 -> three steps of 1 s base + 1 s of prompt tokens in all.
    r = simulate(costs(budget=4), [(10, 1)], math.inf)
    assert r.ttft_p50_ms == pytest.approx(4000)


def test_decode_rows_take_budget_before_waiting_prompts() -> None:
    # Request A decodes while B (arriving together) prefills: budget 5, A's row takes 1, so B gets 4 per step.
    r = simulate(costs(budget=5, per_token=0.0), [(1, 4), (8, 1)], math.inf)
    # Step 1: A's prompt (1) + B's first 4 tokens; step 2: A decodes, B's last 4 -> B's first token at 2 s.
    assert r.ttft_p99_ms == pytest.approx(percentile([1.0, 2.0], 99) * 1e3)


def test_max_num_seqs_holds_later_requests_in_the_queue() -> None:
    r = simulate(costs(seqs=1, per_token=0.0), [(4, 3), (4, 3)], math.inf)
    # The first runs steps 1-3 (prefill + 2 decodes); the second is admitted at step 4: its first token at 4 s.
    assert r.ttft_p99_ms == pytest.approx(percentile([1.0, 4.0], 99) * 1e3)


def test_below_saturation_throughput_is_the_offered_load() -> None:
    c = costs(base=0.02, per_row=0.002, per_token=0.0005, seqs=64, budget=512)
    lengths = [(100, 50)] * 400
    _, sat_rate = saturation_rate(c, lengths)
    light = simulate(c, lengths, 0.3 * sat_rate, seed=1)
    assert light.total_tok_s == pytest.approx(0.3 * sat_rate * 150, rel=0.1)


def test_latency_grows_with_load() -> None:
    c = costs(base=0.02, per_row=0.002, per_token=0.0005, seqs=64, budget=512)
    lengths = [(100, 50)] * 400
    _, sat_rate = saturation_rate(c, lengths)
    low, high = (simulate(c, lengths, f * sat_rate, seed=1) for f in (0.2, 0.9))
    assert high.ttft_p99_ms > low.ttft_p99_ms
    assert high.tpot_p99_ms > low.tpot_p99_ms
    assert high.mean_batch > low.mean_batch


def test_slo_bisection_finds_the_edge() -> None:
    c = costs(base=0.02, per_row=0.002, per_token=0.0005, seqs=64, budget=512)
    lengths = [(100, 50)] * 400
    lat = plan_latency(c, lengths, ttft_slo_ms=None, tpot_slo_ms=40.0)
    assert lat.slo_met and lat.at_slo is not None
    assert lat.at_slo.tpot_p99_ms <= 40.0
    above = simulate(c, lengths, lat.at_slo.request_rate * 1.1)
    assert not meets(above, None, 40.0)
    assert lat.sustained is lat.at_slo
    assert lat.at_slo.total_tok_s < lat.saturation.total_tok_s


def test_an_slo_no_rate_meets_is_reported() -> None:
    lat = plan_latency(costs(), [(10, 3)] * 10, ttft_slo_ms=1.0, tpot_slo_ms=None)  # a step alone takes 1 s
    assert not lat.slo_met


def test_poisson_arrivals_are_seeded_and_have_the_rate() -> None:
    times = arrivals(5000, 4.0, seed=3)
    assert times == arrivals(5000, 4.0, seed=3)
    assert len(times) / times[-1] == pytest.approx(4.0, rel=0.05)
    with pytest.raises(ValueError, match="> 0"):
        arrivals(3, 0.0)


def test_bad_step_costs_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="base cost must be > 0"):
        StepCosts(0.0, 0.0, 0.1, 8, 64)


def _profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                "step_costs": {
                    "decode_base_s": 0.02,
                    "decode_per_row_s": 0.002,
                    "prefill_per_token_s": 0.0005,
                    "max_num_seqs": 64,
                    "max_num_batched_tokens": 512,
                },
                "lengths": [[100, 50], [300, 150]],
                "workload": "test",
                "model": "m",
            }
        )
    )
    return path


def test_profile_round_trip_and_errors(tmp_path: Path) -> None:
    profile = load_profile(_profile_file(tmp_path))
    assert profile.avg_input_tokens == 200 and profile.avg_output_tokens == 100
    bad = tmp_path / "bad.json"
    bad.write_text('{"results": {}}')
    with pytest.raises(ValueError, match="step_costs"):
        load_profile(bad)


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "plan", *args], capture_output=True, text=True, timeout=120
    )


def test_plan_with_a_profile_sizes_by_the_slo_bound_throughput(tmp_path: Path) -> None:
    png = tmp_path / "curve.png"
    out = _plan("--peak-rps", "20", "--profile", str(_profile_file(tmp_path)), "--tpot-slo-ms", "40", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    at_slo = data["latency"]["at_slo"]
    assert at_slo["tpot_p99_ms"] <= 40
    assert data["tokens_per_s_per_replica"] == pytest.approx(at_slo["total_tok_s"])
    expected = math.ceil(20 * 300 / (at_slo["total_tok_s"] * 0.7))
    assert data["replicas"] == expected
    assert data["latency"]["at_peak"]["request_rate"] == pytest.approx(20 / expected)
    drawn = _plan("--peak-rps", "20", "--profile", str(_profile_file(tmp_path)), "--plot", str(png))
    assert drawn.returncode == 0, drawn.stderr
    assert png.stat().st_size > 10_000
    assert "at the planned load" in drawn.stdout


def test_plot_without_a_profile_is_a_clear_error() -> None:
    out = _plan("--peak-rps", "1", "--throughput", "100", "--input-tokens", "1", "--output-tokens", "1", "--plot", "x")
    assert out.returncode == 2
    assert "--plot needs --profile" in out.stderr
