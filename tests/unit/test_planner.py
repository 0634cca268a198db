"""tokenmill.planner: the capacity formula, its costs, its input sources, and `tokenmill plan`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.planner import PlanInputs, PlanRequest, get_profile, plan, resolve, roofline_tok_s

# The worked example: 50 x 700 / (5000 x 0.7) x 1.25 = 12.5 -> 13 replicas.
WORKED = {
    "peak_rps": 50.0,
    "avg_input_tokens": 500.0,
    "avg_output_tokens": 200.0,
    "tokens_per_s_per_replica": 5000.0,
    "utilization": 0.7,
    "redundancy": 1.25,
}
WORKED_ARGV = [
    "plan", "--peak-rps", "50", "--input-tokens", "500", "--output-tokens", "200",
    "--throughput", "5000", "--utilization", "0.7", "--redundancy", "1.25",
]  # fmt: skip


def _bench_file(tmp_path: Path) -> Path:
    """What `tokenmill bench throughput --output-json` writes, trimmed to the keys the planner reads."""
    path = tmp_path / "bench.json"
    results = {"num_requests": 100, "prompt_tokens": 30_000, "output_tokens": 10_000, "total_tok_s": 2000.0}
    path.write_text(json.dumps({"command": "tokenmill bench throughput", "results": results}))
    return path


# --- the formula ---


def test_worked_example_plans_13_replicas_from_12_5() -> None:
    result = plan(PlanInputs(**WORKED))
    assert result.raw_replicas == pytest.approx(12.5)
    assert result.replicas == 13


def test_spare_replicas_are_added_after_rounding() -> None:
    assert plan(PlanInputs(**WORKED, spare=1)).replicas == 14  # ceil(12.5) + 1, not ceil(13.5)


def test_an_exact_integer_does_not_round_up_through_float_error() -> None:
    # 6 x 750 / (100 x 0.9) x 1.1 = 55 exactly; in floats it is 55.00000000000001.
    inputs = PlanInputs(6, 700, 50, 100, utilization=0.9, redundancy=1.1)
    assert inputs.peak_rps * 750 / (100 * 0.9) * 1.1 > 55  # the float error this test is about
    assert plan(inputs).replicas == 55


def test_load_per_replica_utilization_and_headroom_at_peak() -> None:
    result = plan(PlanInputs(**WORKED))
    assert result.load_per_replica_tok_s == pytest.approx(35_000 / 13)
    assert result.utilization_at_peak == pytest.approx(35_000 / 13 / 5000)
    assert result.headroom == pytest.approx(1 - 35_000 / 13 / 5000)


def test_costs_of_the_worked_example_by_hand() -> None:
    costs = plan(PlanInputs(**WORKED, cost_per_hour=2.5)).costs
    assert costs is not None
    fleet_per_s = 13 * 2.5 / 3600  # $ per second for 13 replicas
    assert costs.per_million_output_tokens == pytest.approx(fleet_per_s / (50 * 200) * 1e6)  # 0.9028
    assert costs.per_million_total_tokens == pytest.approx(fleet_per_s / (50 * 700) * 1e6)  # 0.2579
    assert costs.per_day == pytest.approx(13 * 2.5 * 24)  # 780
    assert costs.per_month == pytest.approx(13 * 2.5 * 720)  # 23,400


def test_costs_are_unknown_without_a_price() -> None:
    assert plan(PlanInputs(**WORKED)).costs is None


# --- input sources ---


def test_from_bench_reads_the_means_and_the_measured_throughput(tmp_path: Path) -> None:
    inputs = resolve(PlanRequest(peak_rps=10, from_bench=_bench_file(tmp_path)))
    assert (inputs.avg_input_tokens, inputs.avg_output_tokens) == (300.0, 100.0)
    assert inputs.tokens_per_s_per_replica == 2000.0
    assert plan(inputs).replicas == 3  # 10 x 400 / (2000 x 0.7) = 2.86


def test_explicit_flags_win_over_the_bench_file(tmp_path: Path) -> None:
    inputs = resolve(PlanRequest(peak_rps=10, from_bench=_bench_file(tmp_path), output_tokens=50, throughput=4000))
    assert (inputs.avg_input_tokens, inputs.avg_output_tokens, inputs.tokens_per_s_per_replica) == (300, 50, 4000)


def test_hardware_profile_gives_a_roofline_throughput_and_its_price() -> None:
    inputs = resolve(PlanRequest(peak_rps=100, input_tokens=500, output_tokens=200, hardware="h100"))
    assert inputs.tokens_per_s_per_replica > 0
    assert inputs.cost_per_hour == get_profile("H100").cost_per_hour
    assert inputs.hardware == "H100" and "roofline" in inputs.throughput_source


def test_roofline_decode_is_bandwidth_bound_at_batch_1() -> None:
    h100 = get_profile("H100")
    # output tokens only, batch 1: one read of 2 x 8e9 bytes per token.
    assert roofline_tok_s(h100, 1e-9, 1.0, params_b=8, batch=1) == pytest.approx(3350e9 / 16e9, rel=1e-6)


def test_measured_throughput_beats_the_roofline_and_cost_flag_beats_the_profile() -> None:
    inputs = resolve(
        PlanRequest(peak_rps=1, input_tokens=1, output_tokens=1, throughput=123, hardware="L4", cost_per_hour=9)
    )
    assert (inputs.tokens_per_s_per_replica, inputs.cost_per_hour) == (123, 9)


def test_this_cpu_profile_has_a_throughput_but_no_price() -> None:
    inputs = resolve(PlanRequest(peak_rps=1, input_tokens=100, output_tokens=100, hardware="this-cpu"))
    assert inputs.tokens_per_s_per_replica > 0 and inputs.cost_per_hour is None


# --- bad inputs ---


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokens_per_s_per_replica": 0.0}, "--throughput) must be > 0"),
        ({"tokens_per_s_per_replica": -5.0}, "--throughput) must be > 0"),
        ({"peak_rps": 0.0}, "--peak-rps must be > 0"),
        ({"avg_input_tokens": -1.0}, "--input-tokens must be > 0"),
        ({"avg_output_tokens": 0.0}, "--output-tokens must be > 0"),
        ({"utilization": 0.0}, "--utilization must be in (0, 1]"),
        ({"utilization": 1.5}, "--utilization must be in (0, 1]"),
        ({"redundancy": 0.9}, "--redundancy must be >= 1"),
        ({"spare": -1}, "--spare must be >= 0"),
    ],
)
def test_bad_inputs_are_value_errors_that_name_the_flag(change: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PlanInputs(**{**WORKED, **change})


def test_no_throughput_source_says_which_flags_give_one() -> None:
    with pytest.raises(ValueError, match="pass --throughput .* --from-bench .* --hardware"):
        resolve(PlanRequest(peak_rps=1, input_tokens=1, output_tokens=1))


def test_unknown_hardware_lists_the_profiles() -> None:
    with pytest.raises(ValueError, match="pick one of H100, H200, A100, L4, this-cpu"):
        get_profile("TPU")


def test_a_bench_file_without_results_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"engines": []}')
    with pytest.raises(ValueError, match='no "results" object; pass a file written by `tokenmill bench throughput'):
        resolve(PlanRequest(peak_rps=1, from_bench=path))


# --- tokenmill plan ---


def test_cli_worked_example_prints_13_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    main([*WORKED_ARGV, "--cost-per-hour", "2.5"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["replicas", "13"]
    assert "formula 12.50" in out and "$780.00/day" in out and "$0.9028 per 1M output tokens" in out


def test_cli_json_has_replicas_and_echoes_the_slos(capsys: pytest.CaptureFixture[str]) -> None:
    main([*WORKED_ARGV, "--json", "--ttft-slo-ms", "500", "--tpot-slo-ms", "50"])
    result = json.loads(capsys.readouterr().out)
    assert result["replicas"] == 13 and result["raw_replicas"] == pytest.approx(12.5)
    assert result["costs"] is None
    assert (result["inputs"]["ttft_slo_ms"], result["inputs"]["tpot_slo_ms"]) == (500, 50)


def test_cli_from_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["plan", "--peak-rps", "10", "--from-bench", str(_bench_file(tmp_path)), "--json"])
    assert json.loads(capsys.readouterr().out)["replicas"] == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--throughput", "0"], "--throughput) must be > 0"),
        (["--throughput", "5000", "--utilization", "0"], "--utilization must be in (0, 1]"),
        (["--throughput", "5000", "--utilization", "1.01"], "--utilization must be in (0, 1]"),
        (["--throughput", "5000", "--redundancy", "0.5"], "--redundancy must be >= 1"),
        (["--throughput", "5000", "--spare", "-1"], "--spare must be >= 0"),
        ([], "pass --throughput TOK_S"),
        (["--hardware", "TPU"], "unknown --hardware 'TPU'"),
        (["--from-bench", "/does/not/exist.json"], "cannot read --from-bench"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--peak-rps", "50", "--input-tokens", "500", "--output-tokens", "200", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenmill plan: error: ") and message in err
    assert err.count("\n") == 1
