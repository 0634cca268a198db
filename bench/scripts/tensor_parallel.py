"""Tensor parallelism on this machine (issue 28): TP=2 against TP=1, and what the all-reduces cost.

Usage: .venv/bin/python bench/scripts/tensor_parallel.py [--output bench/results/tensor_parallel.json]
           [--repeats 2] [--num-requests 64] [--model qwen2.5-0.5b]

The qwen2.5-0.5b preset's shape with dummy weights, bf16, the `random-cpu` workload (run_throughput, as
`tokenmill bench throughput`), each run in its own process, the configurations alternating so drifts of a
noisy machine hit them all; medians are quoted. Configurations:
- tp1: one process on every core, as shipped (the fused C++ decode stack on);
- tp1-eager: the same, layer by layer from Python (--enforce-eager): what the fused stack saves, the
  baseline of a TP path without it;
- tp2: two ranks, each pinned to half the cores (one each on a 2-core machine), gloo all-reduces.
Scaling efficiency = tp2 tok/s / (2 x tp1 tok/s). For tp2 the script also reports rank 0's collectives
(all-reduces after o_proj and down_proj, the embedding's, the logits' all-gather): calls and seconds per
engine step, and their share of the timed window."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIGS: dict[str, dict[str, Any]] = {
    "tp1": {"tensor_parallel_size": 1},
    "tp1-eager": {"tensor_parallel_size": 1, "enforce_eager": True},
    "tp2": {"tensor_parallel_size": 2},
}


def one_run(name: str, model: str, num_requests: int | None) -> dict[str, Any]:
    """Runs in a fresh process: build the engine, run the workload, print one JSON line."""
    from tokenmill import LLM
    from tokenmill.bench.datasets import make_workload
    from tokenmill.bench.throughput import run_throughput
    from tokenmill.distributed.communication import COLLECTIVE_STATS

    start = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype="bfloat16", **CONFIGS[name])
    load_s = time.perf_counter() - start
    try:
        requests = make_workload("random-cpu", llm.config.model.vocab_size, num_requests=num_requests)
        calls, seconds, nbytes = COLLECTIVE_STATS.calls, COLLECTIVE_STATS.seconds, COLLECTIVE_STATS.bytes
        result = run_throughput(llm, requests)  # its warm-up runs before the counters below are read
        calls, seconds, nbytes = (
            COLLECTIVE_STATS.calls - calls,
            COLLECTIVE_STATS.seconds - seconds,
            COLLECTIVE_STATS.bytes - nbytes,
        )
        steps = max(result.num_steps, 1)
        return {
            "config": name,
            "load_s": load_s,
            "output_tok_s": result.output_tok_s,
            "total_tok_s": result.total_tok_s,
            "decode_tok_s": result.decode_tok_s,
            "elapsed_s": result.elapsed_s,
            "steps": result.num_steps,
            "fused_decode": llm.engine.runner.fused_decode_off_reason or "on",
            # rank 0's collectives; the warm-up's few are inside (they are small beside the workload's)
            "collective_calls_per_step": calls / steps,
            "collective_ms_per_step": 1e3 * seconds / steps,
            "collective_share_of_time": seconds / result.elapsed_s,
            "collective_mib": nbytes / 2**20,
        }
    finally:
        llm.engine.shutdown()


def run(name: str, model: str, num_requests: int | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", name, "--model", model]
    if num_requests is not None:
        cmd += ["--num-requests", str(num_requests)]
    done = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    tok_s, ms = result["output_tok_s"], result["collective_ms_per_step"]
    print(f"  {name}: {tok_s:.1f} out tok/s, {ms:.2f} ms/step in collectives", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/tensor_parallel.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=None, help="default: the workload's 64")
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.model, args.num_requests)))
        return
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for i in range(args.repeats):
        print(f"repeat {i + 1}/{args.repeats}", flush=True)
        for name in CONFIGS:
            runs[name].append(run(name, args.model, args.num_requests))
    median = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0] if isinstance(rs[0][key], (int, float))}
        for name, rs in runs.items()
    }
    tp1, eager, tp2 = (median[n]["output_tok_s"] for n in ("tp1", "tp1-eager", "tp2"))
    report = {
        "model": args.model,
        "dtype": "bfloat16",
        "workload": "random-cpu",
        "num_requests": args.num_requests or 64,
        "repeats": args.repeats,
        "median": median,
        "tp2_speedup_vs_tp1": tp2 / tp1,
        "scaling_efficiency_vs_tp1": tp2 / (2 * tp1),
        "tp2_speedup_vs_tp1_eager": tp2 / eager,
        "scaling_efficiency_vs_tp1_eager": tp2 / (2 * eager),
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
