"""Speculative decoding (issue 25): speed-up where it helps, no loss where it does not.

Usage: .venv/bin/python bench/scripts/spec_decode.py [--output bench/results/spec_decode.json] [--repeats 3]
           [--parts batch1,load,crossover] [--k-bf16 7] [--k-int8 3]

Every measurement is `tokenmill bench throughput` on the embedded default model, in its own process, speculation
off and on alternating (off, on, off, on, ...) so drifts of this noisy machine hit both; medians are quoted.
1. batch1: `--workload copy-edit --max-num-seqs 1`, bf16 and int8 weights, n-gram drafts (k chosen per weight
   format: the verification step's cost jumps past the packed GEMM's row tile, 8 rows for bf16, 4 for int8):
   output tok/s, acceptance, mean accepted length, and whether the greedy texts are identical.
2. load: `--workload random-cpu` at 8 and 32 concurrent requests, bf16, on (the default disable_by_batch_size)
   and off.
3. crossover: copy-edit and random-cpu at 2, 4 and 8 concurrent requests with speculation forced on
   (disable_by_batch_size 64) against off: where speculation stops paying, which sets the default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run(workload: str, seqs: int, quantization: str | None, spec: dict[str, Any] | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "tokenmill.cli", "bench", "throughput",
            "--workload", workload, "--max-num-seqs", str(seqs), "--dtype", "bfloat16", "--output-json", str(out),
        ]  # fmt: skip
        if quantization:
            cmd += ["--quantization", quantization]
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        result: dict[str, Any] = json.loads(out.read_text())["results"]
    drafts, accepted = result["spec_num_draft_tokens"], result["spec_num_accepted_tokens"]
    summary = {
        "output_tok_s": result["output_tok_s"],
        "decode_tok_s": result["decode_tok_s"],
        "elapsed_s": result["elapsed_s"],
        "steps": result["num_steps"],
        "outputs_sha256": result["outputs_sha256"],
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else None,
        "mean_accepted_length": 1 + accepted / result["spec_num_drafts"] if result["spec_num_drafts"] else None,
    }
    print(f"  {workload} seqs={seqs} q={quantization} spec={spec}: {summary}", flush=True)
    return summary


def pair(workload: str, seqs: int, quantization: str | None, spec: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Off and on, alternating `repeats` times; medians and the on/off ratio of output tok/s."""
    offs, ons = [], []
    for _ in range(repeats):
        offs.append(run(workload, seqs, quantization, None))
        ons.append(run(workload, seqs, quantization, spec))
    off = statistics.median(r["output_tok_s"] for r in offs)
    on = statistics.median(r["output_tok_s"] for r in ons)
    return {
        "workload": workload,
        "max_num_seqs": seqs,
        "quantization": quantization,
        "speculative_config": spec,
        "off_output_tok_s": off,
        "on_output_tok_s": on,
        "ratio": on / off,
        "off_decode_tok_s": statistics.median(r["decode_tok_s"] for r in offs),
        "on_decode_tok_s": statistics.median(r["decode_tok_s"] for r in ons),
        "acceptance_rate": ons[0]["acceptance_rate"],
        "mean_accepted_length": ons[0]["mean_accepted_length"],
        # Only greedy workloads (copy-edit) must give the same texts; random-cpu samples at temperature 0.6.
        "texts_identical": len({r["outputs_sha256"] for r in offs + ons}) == 1 if workload == "copy-edit" else None,
        "runs": {"off": offs, "on": ons},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="bench/results/spec_decode.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="batch1,load,crossover")
    parser.add_argument("--k-bf16", type=int, default=7)
    parser.add_argument("--k-int8", type=int, default=3)
    args = parser.parse_args()
    parts = args.parts.split(",")
    ngram = {"method": "ngram"}
    results: dict[str, Any] = {"command": " ".join(sys.argv), "parts": {}}
    if "batch1" in parts:
        print("batch 1, copy-edit", flush=True)
        results["parts"]["batch1"] = [
            pair("copy-edit", 1, None, {**ngram, "num_speculative_tokens": args.k_bf16}, args.repeats),
            pair("copy-edit", 1, "int8", {**ngram, "num_speculative_tokens": args.k_int8}, args.repeats),
        ]
    if "load" in parts:
        print("random-cpu under load, default disable_by_batch_size", flush=True)
        spec = {**ngram, "num_speculative_tokens": args.k_bf16}
        results["parts"]["load"] = [pair("random-cpu", seqs, None, spec, args.repeats) for seqs in (8, 32)]
    if "crossover" in parts:
        print("crossover: speculation forced on", flush=True)
        forced = {**ngram, "num_speculative_tokens": args.k_bf16, "disable_by_batch_size": 64}
        results["parts"]["crossover"] = [
            pair(workload, seqs, None, forced, max(1, args.repeats - 1))
            for workload in ("copy-edit", "random-cpu")
            for seqs in (2, 4, 8)
        ]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
    for name, rows in results["parts"].items():
        for row in rows:
            print(
                f"{name}: {row['workload']} seqs={row['max_num_seqs']} q={row['quantization']}: "
                f"off {row['off_output_tok_s']:.1f} on {row['on_output_tok_s']:.1f} tok/s = {row['ratio']:.2f}x, "
                f"acceptance {row['acceptance_rate']}, mean accepted {row['mean_accepted_length']}, "
                f"texts identical {row['texts_identical']}"
            )


if __name__ == "__main__":
    main()
