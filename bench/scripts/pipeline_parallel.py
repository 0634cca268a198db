"""Pipeline parallelism on this machine (issue 51): PP=2 against PP=1 and TP=2, and how long each stage
waits.

Usage: .venv/bin/python bench/scripts/pipeline_parallel.py [--output bench/results/<cpu>/pipeline_parallel.json]
           [--repeats 2] [--num-requests 64] [--model qwen2.5-0.5b]

The qwen2.5-0.5b preset's shape with dummy weights, bf16, the `random-cpu` workload (run_throughput, as
`tokenmill bench throughput`), each run in its own process, the configurations alternating so drifts of a
noisy machine hit them all; medians are quoted. Configurations:
- pp1: one process on every core, as shipped (the fused C++ decode stack on where the CPU has it);
- pp1-eager: the same, layer by layer from Python (--enforce-eager): pipeline stages run their layers
  this way, so this is the baseline that isolates what splitting the layers costs;
- tp2: two tensor-parallel ranks, each pinned to half the cores;
- pp2: two pipeline stages, each pinned to half the cores, 17 + 7 layers (--pp-layer-partition 17,7:
  the last stage also runs the 151,936 x 896 LM head, 9 layers' worth of weights); two steps in flight,
  each with half the requests;
- pp2-even: the same with 12 + 12 layers (the default split).
Scaling efficiency = tok/s / (2 x pp1 tok/s). For pp2 each stage's busy and waiting seconds over the
run (warm-up included) give its idle share."""

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
    "pp1": {},
    "pp1-eager": {"enforce_eager": True},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2, "pp_layer_partition": "17,7"},
    "pp2-even": {"pipeline_parallel_size": 2},
}


def one_run(name: str, model: str, num_requests: int | None) -> dict[str, Any]:
    """Runs in a fresh process: build the engine, run the workload, print one JSON line."""
    from tokenmill import LLM
    from tokenmill.bench.datasets import make_workload
    from tokenmill.bench.throughput import run_throughput

    start = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype="bfloat16", **CONFIGS[name])
    load_s = time.perf_counter() - start
    try:
        requests = make_workload("random-cpu", llm.config.model.vocab_size, num_requests=num_requests)
        result = run_throughput(llm, requests)
        report: dict[str, Any] = {
            "config": name,
            "load_s": load_s,
            "output_tok_s": result.output_tok_s,
            "total_tok_s": result.total_tok_s,
            "elapsed_s": result.elapsed_s,
            "steps": result.num_steps,
            "fused_decode": llm.engine.runner.fused_decode_off_reason or "on",
        }
        if name.startswith("pp2"):
            for stage, (busy, wait) in enumerate(llm.engine.executor.stage_times()):  # type: ignore[attr-defined]
                report[f"stage{stage}_busy_s"] = busy
                report[f"stage{stage}_wait_s"] = wait
                report[f"stage{stage}_idle_share"] = wait / (busy + wait)
        return report
    finally:
        llm.engine.shutdown()


def run(name: str, model: str, num_requests: int | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", name, "--model", model]
    if num_requests is not None:
        cmd += ["--num-requests", str(num_requests)]
    done = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    idle = [f"stage {s} idle {result[f'stage{s}_idle_share']:.0%}" for s in (0, 1) if f"stage{s}_idle_share" in result]
    print(f"  {name}: {result['output_tok_s']:.1f} out tok/s {', '.join(idle)}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, help="the JSON result (bench/results/<cpu>/pipeline_parallel.json)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=None, help="default: the workload's 64")
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.model, args.num_requests)))
        return
    if args.output is None:
        parser.error("--output is required")
    from tokenmill.bench.hardware_info import cpu_model_name, isa_flags

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for i in range(args.repeats):
        print(f"repeat {i + 1}/{args.repeats}", flush=True)
        for name in CONFIGS:
            runs[name].append(run(name, args.model, args.num_requests))
    median = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0] if isinstance(rs[0][key], (int, float))}
        for name, rs in runs.items()
    }
    tok_s = {name: median[name]["output_tok_s"] for name in CONFIGS}
    report = {
        "benchmark": "pipeline_parallel",
        "command": "python bench/scripts/pipeline_parallel.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_model_name(),
        "cpu_isa": isa_flags(),
        "model": args.model,
        "dtype": "bfloat16",
        "workload": "random-cpu",
        "num_requests": args.num_requests or 64,
        "repeats": args.repeats,
        "median": median,
        "pp2_vs_pp1": tok_s["pp2"] / tok_s["pp1"],
        "pp2_vs_pp1_eager": tok_s["pp2"] / tok_s["pp1-eager"],
        "pp2_vs_tp2": tok_s["pp2"] / tok_s["tp2"],
        "pp2_vs_pp2_even": tok_s["pp2"] / tok_s["pp2-even"],
        "scaling_efficiency_pp2": tok_s["pp2"] / (2 * tok_s["pp1"]),
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
