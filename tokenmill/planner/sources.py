"""Turn what the user gave (flags, a bench file, a hardware name) into `PlanInputs`.

Precedence: explicit flags win; then a `--profile` calibration (`tokenmill bench calibrate`: the workload's
means, and the total tok/s one replica sustains within the SLOs, simulated); then a `--from-bench` file (the
workload's means and its measured total tok/s); then a `--hardware` roofline for the throughput. The hardware
profile's $/hour is used whenever a profile is named and `--cost-per-hour` is not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tokenmill.planner.bench_file import load_bench
from tokenmill.planner.capacity import PlanInputs, require_positive
from tokenmill.planner.hardware import DEFAULT_BATCH, DEFAULT_PARAMS_B, get_profile, roofline_tok_s
from tokenmill.planner.latency import LatencyPlan, plan_latency, workload_lengths
from tokenmill.planner.step_model import Profile, load_profile

NO_THROUGHPUT = (
    "no throughput per replica: pass --throughput TOK_S (measured total tokens/s), --profile FILE.json (a "
    "`tokenmill bench calibrate` file), --from-bench FILE.json (a `tokenmill bench throughput --output-json` "
    "file) or --hardware NAME (a roofline estimate)."
)


@dataclass(frozen=True)
class PlanRequest:
    """The `tokenmill plan` flags, unresolved; None means "not given"."""

    peak_rps: float | None = None
    input_tokens: float | None = None
    output_tokens: float | None = None
    throughput: float | None = None
    from_bench: str | Path | None = None
    profile: str | Path | None = None
    hardware: str | None = None
    params_b: float = DEFAULT_PARAMS_B
    batch: int = DEFAULT_BATCH
    utilization: float = 0.7
    redundancy: float = 1.0
    spare: int = 0
    cost_per_hour: float | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    cached_prompt_share: float = 0.0  # with --profile: see StepCosts
    cached_load_us: float = 0.0


@dataclass(frozen=True)
class Resolved:
    """The formula's inputs, and with a calibration the latency model behind its throughput."""

    inputs: PlanInputs
    calibration: Profile | None = None
    lengths: list[tuple[int, int]] | None = None  # the simulated workload
    latency: LatencyPlan | None = None


def resolve(request: PlanRequest) -> PlanInputs:
    """The inputs of the capacity formula, from flags, a bench file and a hardware profile (module docstring)."""
    return resolve_all(request).inputs


def resolve_all(request: PlanRequest) -> Resolved:
    """`resolve`, keeping the calibration and the latency plan a `--profile` gave."""
    if request.peak_rps is None:
        raise ValueError("--peak-rps is required: the peak requests per second the fleet must serve.")
    for flag, slo in (("--ttft-slo-ms", request.ttft_slo_ms), ("--tpot-slo-ms", request.tpot_slo_ms)):
        if slo is not None:
            require_positive(flag, slo)  # before the simulation compares against it
    calibration = load_profile(request.profile) if request.profile is not None else None
    if calibration is None and (request.cached_prompt_share or request.cached_load_us):
        raise ValueError(
            "--cached-prompt-share and --cached-load-us need --profile FILE.json: they change its simulation."
        )
    if calibration is not None:
        costs = replace(
            calibration.costs,
            cached_prompt_share=request.cached_prompt_share,
            cached_load_per_token_s=request.cached_load_us * 1e-6,
        )
        calibration = replace(calibration, costs=costs)
    bench = load_bench(request.from_bench) if request.from_bench is not None else None
    measured = calibration or bench
    avg_input = _pick(request.input_tokens, measured.avg_input_tokens if measured else None, "--input-tokens")
    avg_output = _pick(request.output_tokens, measured.avg_output_tokens if measured else None, "--output-tokens")
    require_positive("--input-tokens", avg_input)  # before the roofline divides by them
    require_positive("--output-tokens", avg_output)
    profile = get_profile(request.hardware) if request.hardware is not None else None
    lengths = latency = None
    if calibration is not None:
        lengths = workload_lengths(calibration, request.input_tokens, request.output_tokens)
        latency = plan_latency(calibration.costs, lengths, request.ttft_slo_ms, request.tpot_slo_ms)
    if request.throughput is not None:
        throughput, source = request.throughput, "--throughput"
    elif calibration is not None and latency is not None:
        throughput = latency.sustained.total_tok_s
        bound = "within the SLOs" if latency.at_slo is not None else "at saturation"
        source = f"simulated from {calibration.path}, {bound}"
    elif bench is not None:
        throughput, source = bench.total_tok_s, f"measured in {bench.path}"
    elif profile is not None:
        throughput = roofline_tok_s(profile, avg_input, avg_output, request.params_b, request.batch)
        source = f"roofline estimate: {profile.name}, {request.params_b:g}B params, batch {request.batch}"
    else:
        raise ValueError(NO_THROUGHPUT)
    cost = request.cost_per_hour if request.cost_per_hour is not None else (profile.cost_per_hour if profile else None)
    inputs = PlanInputs(
        peak_rps=request.peak_rps,
        avg_input_tokens=avg_input,
        avg_output_tokens=avg_output,
        tokens_per_s_per_replica=throughput,
        throughput_source=source,
        utilization=request.utilization,
        redundancy=request.redundancy,
        spare=request.spare,
        cost_per_hour=cost,
        hardware=profile.name if profile else None,
        ttft_slo_ms=request.ttft_slo_ms,
        tpot_slo_ms=request.tpot_slo_ms,
    )
    return Resolved(inputs, calibration, lengths, latency)


def _pick(given: float | None, from_bench: float | None, flag: str) -> float:
    if given is not None:
        return given
    if from_bench is not None:
        return from_bench
    raise ValueError(
        f"{flag} is required (the mean per request), or pass --profile or --from-bench FILE.json to read it."
    )
