"""Check `tokenmill plan`'s latency model against `tokenmill bench serve` on this machine (issue 29).

Usage: .venv/bin/python bench/scripts/planner_validation.py [--runs 3] [--num-prompts 64] [--port 8031]
           [--output bench/results/planner_validation.json] [--serve-args "--max-num-seqs 64"]
           [--calibrate-prompts N]

1. Start `tokenmill serve` and calibrate once through it: `tokenmill bench calibrate --server URL` drives the
   server at a few concurrencies and fits the step costs (base, per decode row, per prompt token) to the steps
   it served, so the model sees what serving costs the engine on this machine (the server's own process and
   the load generator share the cores with it; offline calibration, the engine alone, ran 40-60% optimistic
   on TPOT on 2 cores).
2. Predict, from the calibration alone, the saturation request rate of `random-cpu` and, at 30%, 60% and 90% of
   it, the output throughput, TTFT p99 and TPOT p99 of each run: each run is `bench serve --seed S` (S unique,
   so no prompt repeats into the prefix cache), whose requests and Poisson arrival times the simulation replays
   exactly (they are a known input, not noise).
3. Measure the same with `tokenmill bench serve` --runs times per load; compare the
   medians: prediction error per figure (targets: throughput within 15%, TTFT/TPOT p99 within 30%).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenmill.bench.datasets import MAX_TOKEN_ID, make_workload
from tokenmill.planner.latency import saturation_rate
from tokenmill.planner.simulate import simulate
from tokenmill.planner.step_model import load_profile

ROOT = Path(__file__).resolve().parents[2]
_VENV_TOKENMILL = Path(sys.executable).with_name("tokenmill")
TOKENMILL = str(_VENV_TOKENMILL) if _VENV_TOKENMILL.exists() else shutil.which("tokenmill") or "tokenmill"
LOADS = (0.3, 0.6, 0.9)
LATENCY_LOADS = (0.3, 0.6)
WORKLOAD = "random-cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--serve-args", default="")
    parser.add_argument(
        "--calibrate-prompts", type=int, default=None, help="requests the calibration sends (default: its own, 107)"
    )
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/planner_validation.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="planner-validation-"))
    profile_path = work / "profile.json"
    engine = shlex.split(args.serve_args)
    predicted: dict[float, list[dict[str, float]]] = {load: [] for load in LOADS}
    measured: dict[float, list[dict[str, float]]] = {load: [] for load in LOADS}
    with Server(args.port, engine, work / "serve.log") as server:
        start = time.perf_counter()
        calibrate = [TOKENMILL, "bench", "calibrate", "--server", server.url, "--workload", WORKLOAD]
        if args.calibrate_prompts is not None:
            calibrate += ["--num-prompts", str(args.calibrate_prompts)]
        subprocess.run([*calibrate, "--output-json", str(profile_path), *engine], check=True)
        calibrate_s = time.perf_counter() - start
        profile = load_profile(profile_path)
        _, sat_rate = saturation_rate(profile.costs, profile.lengths * 8)  # a long run: what the engine sustains
        print(f"calibrated through the server in {calibrate_s:.0f} s; predicted saturation {sat_rate:.2f} req/s")
        for run in range(args.runs):
            for i, load in enumerate(LOADS):
                # A seed per run and load: a repeated prompt would hit the server's prefix cache.
                seed, rate = run * len(LOADS) + i, load * sat_rate
                predicted[load].append(predict(profile_path, args.num_prompts, rate, seed))
                measured[load].append(server.bench(rate, args.num_prompts, seed, work / f"r{load}.json"))
    rows = []
    for load in LOADS:
        med = {k: statistics.median(m[k] for m in measured[load]) for k in measured[load][0]}
        pred = {k: statistics.median(p[k] for p in predicted[load]) for k in predicted[load][0]}
        row: dict[str, Any] = {"load": load, "request_rate": load * sat_rate, "predicted": pred}
        row["predicted_runs"] = predicted[load]
        row["measured_median"] = med
        row["measured_runs"] = measured[load]
        keys = ["output_tok_s"] + (["ttft_p99_ms", "tpot_p99_ms"] if load in LATENCY_LOADS else [])
        row["error"] = {k: pred[k] / med[k] - 1 for k in keys}
        rows.append(row)
        print(
            f"{load:.0%} of saturation ({load * sat_rate:.2f} req/s): "
            + ", ".join(f"{k} predicted {pred[k]:.1f} measured {med[k]:.1f} ({row['error'][k]:+.0%})" for k in keys)
        )
    report = {
        "command": shlex.join(sys.argv),
        "workload": WORKLOAD,
        "num_prompts": args.num_prompts,
        "runs": args.runs,
        "calibrate_s": calibrate_s,
        "profile": json.loads(profile_path.read_text()) | {"lengths": "omitted"},
        "saturation_rate_predicted": sat_rate,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


def predict(profile_path: Path, num_prompts: int, rate: float, seed: int) -> dict[str, float]:
    """The simulated `bench serve --seed seed --request-rate rate`: its requests, its arrival times."""
    costs = load_profile(profile_path).costs
    requests = make_workload(WORKLOAD, MAX_TOKEN_ID, seed=seed, num_requests=num_prompts)
    lengths = [(len(r.prompt_token_ids), r.output_len) for r in requests]
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_prompts)  # as bench serve draws them
    result = simulate(costs, lengths, rate, arrival_times=np.cumsum(gaps).tolist())
    return {"output_tok_s": result.output_tok_s, "ttft_p99_ms": result.ttft_p99_ms, "tpot_p99_ms": result.tpot_p99_ms}


class Server:
    """`tokenmill serve` on the embedded model for the duration of a `with` block."""

    def __init__(self, port: int, engine_args: list[str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [TOKENMILL, "serve", "--port", str(port), *engine_args]
        self.log_path = log

    def __enter__(self) -> Server:
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited; see {self.log_path}")
            time.sleep(1)
        raise RuntimeError("the server did not get ready in 10 minutes")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()

    def bench(self, rate: float, num_prompts: int, seed: int, out: Path) -> dict[str, float]:
        cmd = [TOKENMILL, "bench", "serve", "--base-url", self.url, "--workload", WORKLOAD, "--seed", str(seed)]
        cmd += ["--num-prompts", str(num_prompts), "--request-rate", repr(rate), "--output-json", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())["results"][0]
        return {
            "output_tok_s": result["output_throughput"],
            "ttft_p99_ms": result["latency_ms"]["ttft"]["p99"],
            "tpot_p99_ms": result["latency_ms"]["tpot"]["p99"],
        }


if __name__ == "__main__":
    main()
