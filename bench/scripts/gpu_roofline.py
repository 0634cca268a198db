"""How close `bench throughput` runs on a GPU came to the device's decode roofline (tokenmill/bench/roofline.py):
the HBM bandwidth and the model's GEMM rates are measured on the GPU now, and each result is set against
the decode ceiling at its own batch (max_num_seqs, or fewer requests) and mean context.

The decode ceiling counts output tokens only: with prompts P and outputs O tokens long, no engine reaches
more than about O / (P + O) of it, so both that share and the compute fraction (the matmul FLOPs of prompt
and output tokens against the peak GEMM rate) are printed beside the fraction.

Usage: python bench/scripts/gpu_roofline.py --model qwen3-0.6b --output-json roof.json r1.json [r2.json ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.roofline import ModelShape, compute_fraction, decode_roofline, format_roofline, measure_rates
from tokenmill.loader.presets import PRESETS


def judge(result_path: Path, shape: ModelShape, device: str) -> dict[str, Any]:
    report = json.loads(result_path.read_text())
    res, cfg = report["results"], report["config"]
    batch = min(int(cfg["max_num_seqs"]), int(res["num_requests"]))
    mean_prompt = res["prompt_tokens"] / res["num_requests"]
    mean_output = res["output_tokens"] / res["num_requests"]
    avg_context = mean_prompt + mean_output / 2  # a decode step's context, averaged over a request's life
    dtype = cfg["weight_dtype"]
    rates = measure_rates(shape, dtype, batch, threads=torch.get_num_threads(), device=device)
    roof = decode_roofline(shape, rates, batch, avg_context, weight_dtype=dtype, kv_dtype=cfg["kv_cache_dtype"])
    print(f"{result_path.name}: {format_roofline(rates, roof)}")
    elapsed = res["elapsed_s"]
    fraction = res["output_tok_s"] / roof.ceiling_tok_s
    share = res["output_tokens"] / (res["prompt_tokens"] + res["output_tokens"])
    used = compute_fraction(shape, rates, res["prompt_tokens"] / elapsed, res["output_tokens"] / elapsed)
    print(
        f"  output {res['output_tok_s']:.0f} tok/s = {fraction:.1%} of the decode ceiling "
        f"(outputs are {share:.0%} of all tokens); matmuls used {used:.1%} of the peak GEMM rate"
    )
    return {
        "result": result_path.name,
        "output_tok_s": res["output_tok_s"],
        "roofline": roof.to_dict(),
        "rates": vars(rates),
        "fraction_of_decode_ceiling": fraction,
        "output_share_of_tokens": share,
        "compute_fraction": used,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output-json", type=Path, required=True)
    parser.add_argument("results", type=Path, nargs="+", help="bench throughput --output-json files")
    args = parser.parse_args()
    shape = ModelShape.from_hf_config(PRESETS[args.model])
    judged = [judge(path, shape, args.device) for path in args.results if path.exists()]
    if judged:
        median = statistics.median(j["fraction_of_decode_ceiling"] for j in judged)
        print(f"median fraction of the decode ceiling: {median:.1%}")
    args.output_json.write_text(json.dumps({"model": args.model, "device": args.device, "runs": judged}, indent=2))


if __name__ == "__main__":
    main()
