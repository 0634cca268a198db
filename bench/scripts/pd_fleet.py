"""Prefill/decode disaggregation against colocated replicas, under load (issue 51): the same two cores
as two replicas that each do both, or as one prefill replica and one decode replica.

Usage: .venv/bin/python bench/scripts/pd_fleet.py [--num-prompts 24] [--request-rate 0.25]
           --output bench/results/<cpu>/pd_fleet.json

For each layout, `tokenmill serve` (the embedded model by default) through Ray Serve, 1 CPU per replica:
- colocated: `--replicas 2`;
- disaggregated: `--replicas 1 --prefill-replicas 1` on one KV tier folder (a fresh temporary one);
then `tokenmill bench serve --workload fixed-1024-128` (1,024 random prompt tokens, 128 out, Poisson
arrivals at --request-rate, seeded). Reported: output throughput, TTFT and ITL (mean, p50, p99), and the
disaggregated fleet's prefill hops and the decode replica's loaded prompt tokens (from /metrics)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from fleet_common import bench_serve, metric_sum, metrics, serving

from tokenmill.bench.hardware_info import cpu_model_name, isa_flags

LAYOUTS = {
    "colocated": ["--replicas", "2"],
    "disaggregated": ["--replicas", "1", "--prefill-replicas", "1", "--pd-min-prompt-tokens", "256"],
}


def run_layout(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    tier = work / f"{name}-tier"
    serve_args = [*args.model, *LAYOUTS[name], *args.serve_args.split()]
    serve_args += ["--kv-offloading-size", "2", "--kv-offloading-path", str(tier)]  # both: the same cache sizes
    with serving(serve_args, args.port, work / f"{name}.serve.log") as url:
        load = ["--workload", "fixed-1024-128", "--num-prompts", str(args.num_prompts)]
        load += ["--request-rate", str(args.request_rate), "--seed", "0"]
        result = bench_serve(url, work / f"{name}.json", *load)
        text = metrics(url)
    latency = result["latency_ms"]
    return {
        "layout": name,
        "serve_args": serve_args,
        "output_throughput": result["output_throughput"],
        "ttft_ms": latency["ttft"],
        "itl_ms": latency["itl"],
        "tpot_ms": latency["tpot"],
        "prefill_hops": {
            outcome: metric_sum(text, "tokenmill:router_prefill_hops_total", outcome=outcome)
            for outcome in ("prefilled", "failed", "skipped")
        },
        "tier_hit_tokens": metric_sum(text, "tokenmill:kv_tier_hit_tokens_total"),
        "prompt_tokens_computed": metric_sum(text, "tokenmill:prompt_tokens_total"),
        "bench_serve": result,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="*", default=[], help="model argument(s) of tokenmill serve")
    parser.add_argument("--serve-args", default="--max-model-len 2048", help="more tokenmill serve flags")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--request-rate", type=float, default=0.25)
    parser.add_argument("--port", type=int, default=8942)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_layout(name, args, Path(tmp)) for name in LAYOUTS]
    for run in runs:
        ttft, itl = run["ttft_ms"], run["itl_ms"]
        print(
            f"{run['layout']:>13}: {run['output_throughput']:.1f} output tok/s, TTFT p50 {ttft['median']:.0f} "
            f"p99 {ttft['p99']:.0f} ms, ITL p50 {itl['median']:.0f} p99 {itl['p99']:.0f} ms, "
            f"hops {run['prefill_hops']}, tier hit tokens {run['tier_hit_tokens']:.0f}"
        )
    report = {
        "workload": "fixed-1024-128",
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "benchmark": "pd_fleet",
        "command": "python bench/scripts/pd_fleet.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_model_name(),
        "cpu_isa": isa_flags(),
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
