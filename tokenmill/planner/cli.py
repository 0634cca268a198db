"""`tokenmill plan`: capacity and cost planning from the command line.

    tokenmill plan --peak-rps 50 --input-tokens 500 --output-tokens 200 --throughput 5000 \\
        --utilization 0.7 --redundancy 1.25 --cost-per-hour 2.5        # 13 replicas (12.5 rounded up)
    tokenmill plan --peak-rps 20 --from-bench results.json --json
    tokenmill plan --peak-rps 200 --input-tokens 500 --output-tokens 200 --hardware H100 --spare 1
    tokenmill bench calibrate --output-json profile.json       # one short run: what a step costs here
    tokenmill bench calibrate --server URL --output-json profile.json    # the same, as a live server serves
    tokenmill plan --peak-rps 5 --profile profile.json --ttft-slo-ms 2000 --tpot-slo-ms 100 --plot curve.png

With --profile, the throughput per replica is the most a simulated replica sustains with its TTFT and TPOT
p99 within the SLOs, and the plan also predicts the p99s at the planned load (tokenmill/planner/simulate.py).

Bad inputs print one line on stderr and exit 2 (a value that is not a number is an argparse usage error, also 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from tokenmill.planner.capacity import Plan, PlanInputs, plan
from tokenmill.planner.hardware import DEFAULT_BATCH, DEFAULT_PARAMS_B, hardware_names
from tokenmill.planner.latency import LatencyPlan
from tokenmill.planner.simulate import SimResult, simulate
from tokenmill.planner.sources import PlanRequest, Resolved, resolve_all


def add_plan_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add `plan` to the top-level `tokenmill` subparsers."""
    p = subparsers.add_parser(
        "plan",
        help="capacity and cost planning: replicas for a peak load, cost per million tokens",
        description="replicas = ceil(peak_rps x (input + output tokens) / (throughput x utilization) x redundancy)"
        " + spare",
    )
    work = p.add_argument_group("workload")
    work.add_argument("--peak-rps", type=float, default=None, help="peak requests per second (required)")
    work.add_argument("--input-tokens", type=float, default=None, help="mean prompt tokens per request")
    work.add_argument("--output-tokens", type=float, default=None, help="mean output tokens per request")
    work.add_argument(
        "--from-bench",
        default=None,
        metavar="FILE.json",
        help="a `tokenmill bench throughput --output-json` file: its mean tokens per request and its measured "
        "total tok/s (flags given explicitly win)",
    )
    hw = p.add_argument_group("throughput per replica (one of these; a measurement beats the estimate)")
    hw.add_argument("--throughput", type=float, default=None, help="measured total (prompt + output) tok/s")
    hw.add_argument(
        "--profile",
        default=None,
        metavar="FILE.json",
        help="a `tokenmill bench calibrate` file: simulate a replica for its throughput within the SLOs and "
        "its latencies at the planned load (also gives the workload's means)",
    )
    hw.add_argument(
        "--hardware",
        default=None,
        metavar="NAME",
        help=f"a named profile ({', '.join(hardware_names())}): a roofline estimate of tok/s (a ceiling), "
        "and the profile's $/hour",
    )
    hw.add_argument("--params", type=float, default=DEFAULT_PARAMS_B, help="model size in billions, for --hardware")
    hw.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="decode batch, for --hardware")
    fleet = p.add_argument_group("fleet")
    fleet.add_argument("--utilization", type=float, default=0.7, help="target utilization in (0, 1] (default 0.7)")
    fleet.add_argument("--redundancy", type=float, default=1.0, help="a multiplier >= 1 (default 1.0)")
    fleet.add_argument("--spare", type=int, default=0, help="replicas added after rounding, e.g. 1 for N+1")
    fleet.add_argument(
        "--cost-per-hour", type=float, default=None, help="$ per replica-hour (default: the --hardware profile's)"
    )
    slo = p.add_argument_group("SLOs (p99; with --profile they bound the throughput per replica)")
    slo.add_argument("--ttft-slo-ms", type=float, default=None)
    slo.add_argument("--tpot-slo-ms", type=float, default=None)
    cache = p.add_argument_group("prefix cache (with --profile)")
    cache.add_argument(
        "--cached-prompt-share",
        type=float,
        default=0.0,
        help="share of prompt tokens found in the prefix cache (the KV cache or its second tier): not computed "
        "(see usage.prompt_tokens_details.cached_tokens / prompt_tokens, or tokenmill:prefix_cache_hits)",
    )
    cache.add_argument(
        "--cached-load-us",
        type=float,
        default=0.0,
        help="microseconds to read one cached token back from a second KV tier (rate(kv_tier_load_seconds) / "
        "rate(kv_tier_hit_tokens)); 0 for the KV cache's own blocks (default)",
    )
    p.add_argument("--json", action="store_true", help='print the plan as JSON (with a "replicas" key)')
    p.add_argument("--plot", default=None, metavar="FILE.png", help="with --profile: throughput against p99 latency")
    p.set_defaults(func=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> None:
    request = PlanRequest(
        peak_rps=args.peak_rps,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        throughput=args.throughput,
        from_bench=args.from_bench,
        hardware=args.hardware,
        params_b=args.params,
        batch=args.batch,
        utilization=args.utilization,
        redundancy=args.redundancy,
        spare=args.spare,
        cost_per_hour=args.cost_per_hour,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        profile=args.profile,
        cached_prompt_share=args.cached_prompt_share,
        cached_load_us=args.cached_load_us,
    )
    try:
        if args.plot is not None and args.profile is None:
            raise ValueError("--plot needs --profile FILE.json: the curve is simulated from a calibration.")
        resolved = resolve_all(request)
        result = plan(resolved.inputs)
    except ValueError as exc:
        print(f"tokenmill plan: error: {exc}", file=sys.stderr)
        sys.exit(2)
    at_peak = peak_latency(resolved, result)
    if args.plot is not None and resolved.calibration is not None and resolved.lengths is not None:
        from tokenmill.planner.plot import plot_curve

        plot_curve(resolved.calibration.costs, resolved.lengths, resolved.inputs, args.plot)
    if args.json:
        data = result.to_dict()
        if resolved.latency is not None:
            data["latency"] = resolved.latency.to_dict() | {"at_peak": asdict(at_peak) if at_peak else None}
        print(json.dumps(data, indent=2))
        return
    print(format_plan(result))
    if resolved.latency is not None and at_peak is not None:
        print(format_latency(resolved.latency, resolved.inputs, at_peak))


def peak_latency(resolved: Resolved, result: Plan) -> SimResult | None:
    """The simulated figures of one replica at its share of the peak (with --profile)."""
    if resolved.calibration is None or resolved.lengths is None:
        return None
    return simulate(resolved.calibration.costs, resolved.lengths, resolved.inputs.peak_rps / result.replicas)


def format_latency(lat: LatencyPlan, i: PlanInputs, at_peak: SimResult) -> str:
    """The simulated replica: saturation, the SLO-bound rate, and the p99s at the planned load."""
    sat = lat.saturation
    lines = [
        f"simulated replica   saturation {sat.total_tok_s:,.0f} tok/s total ({sat.output_tok_s:,.0f} output)",
    ]
    if lat.at_slo is not None:
        met = "" if lat.slo_met else "  (no rate meets the SLOs: figures at the lightest load tried)"
        s = lat.at_slo
        lines.append(
            f"within the SLOs     {s.request_rate:.3g} req/s, {s.total_tok_s:,.0f} tok/s:"
            f" TTFT p99 {s.ttft_p99_ms:,.0f} ms, TPOT p99 {s.tpot_p99_ms:,.1f} ms{met}"
        )
    lines.append(
        f"at the planned load {at_peak.request_rate:.3g} req/s per replica: TTFT p99 {at_peak.ttft_p99_ms:,.0f} ms,"
        f" TPOT p99 {at_peak.tpot_p99_ms:,.1f} ms (mean decode batch {at_peak.mean_batch:.1f})"
    )
    slos = [f"{name} {v:g} ms" for name, v in (("TTFT p99", i.ttft_slo_ms), ("TPOT p99", i.tpot_slo_ms)) if v]
    if slos:
        lines.append(f"SLOs                {', '.join(slos)}")
    return "\n".join(lines)


def format_plan(p: Plan) -> str:
    """A short readable block: replicas, per-replica throughput and load at peak, headroom, costs."""
    i = p.inputs
    spare = f" + {i.spare} spare" if i.spare else ""
    lines = [
        f"replicas            {p.replicas}  (formula {p.raw_replicas:.2f}, rounded up{spare})",
        f"peak load           {i.peak_rps:g} req/s x ({i.avg_input_tokens:g} + {i.avg_output_tokens:g}) tokens"
        f" = {p.peak_tokens_per_s:,.0f} tok/s",
        f"per replica         {i.tokens_per_s_per_replica:,.0f} tok/s ({i.throughput_source})",
        f"at peak             {p.load_per_replica_tok_s:,.0f} tok/s each: {p.utilization_at_peak:.1%} utilization,"
        f" {p.headroom:.1%} headroom (target {i.utilization:.0%}, redundancy {i.redundancy:g})",
    ]
    if p.costs is None:
        lines.append("cost                unknown (pass --cost-per-hour or a --hardware profile)")
    else:
        c = p.costs
        lines += [
            f"cost                ${c.cost_per_hour:.2f}/replica-hour: ${c.per_day:,.2f}/day,"
            f" ${c.per_month:,.2f}/month",
            f"                    ${c.per_million_output_tokens:.4f} per 1M output tokens,"
            f" ${c.per_million_total_tokens:.4f} per 1M total tokens (at peak)",
        ]
    return "\n".join(lines)
