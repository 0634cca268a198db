"""Prefill/decode disaggregation through the file tier (issue 51): what moving a prompt's KV costs against
computing it, the number that decides whether a decode engine should load a prefill engine's blocks.

Usage: .venv/bin/python bench/scripts/pd_transfer.py [--prompt-tokens 2048] [--prompts 4] [--repeats 3]
           --output bench/results/<cpu>/pd_transfer.json

The embedded model (SmolLM2-135M), bf16, prompts of random tokens, one at a time (max_tokens 1), in one
process on every core:
- colocated: an engine without a tier computes each prompt (its time to first token);
- prefill: an engine with --kv-role prefill computes it and writes its blocks to the tier's folder before
  returning (time to first token + the write);
- decode: an engine with --kv-role decode on the same folder, asked next, loads the blocks and computes
  only the prompt's last partial block (its time to first token, the load included).
Medians over the repeats (each repeat a fresh folder)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill import LLM, SamplingParams
from tokenmill.bench.hardware_info import cpu_model_name, isa_flags

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def timed(llm: LLM, prompts: list[list[int]]) -> list[float]:
    """Seconds to each prompt's first (only) token, one prompt at a time."""
    seconds = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([prompt], ONE_TOKEN, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    import torch

    kwargs: dict[str, Any] = {"dtype": "bfloat16", "max_model_len": args.prompt_tokens + 16}
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"colocated": [], "prefill": [], "decode": []}
    load_s: list[float] = []
    with LLM(**kwargs) as warm:  # the vocabulary, and the kernels and packed weights warmed on disk
        vocab = warm.config.model.vocab_size
    for repeat in range(args.repeats):
        prompts = [
            torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist() for _ in range(args.prompts)
        ]
        warmup = [torch.randint(3, vocab, (64,), generator=generator).tolist()]
        with tempfile.TemporaryDirectory() as folder:
            tier = {"kv_offloading_size": 4.0, "kv_offloading_path": folder}
            with LLM(**kwargs) as colocated:
                timed(colocated, warmup)
                times["colocated"] += timed(colocated, prompts)
            with LLM(kv_role="prefill", **tier, **kwargs) as prefill:
                timed(prefill, warmup)
                times["prefill"] += timed(prefill, prompts)
                block_nbytes = prefill.engine.runner.kv_tier.block_nbytes  # type: ignore[union-attr]
            with LLM(kv_role="decode", **tier, **kwargs) as decode:
                timed(decode, warmup)
                times["decode"] += timed(decode, prompts)
                stats = decode.engine.kv_tier_stats
                assert stats is not None and stats.load_failures == 0
                load_s.append(stats.load_seconds / args.prompts)
        print(
            f"repeat {repeat + 1}: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.0f} ms" for k, v in times.items())
        )
    median = {name: statistics.median(values) for name, values in times.items()}
    block_size = 16
    kv_bytes = (args.prompt_tokens - 1) // block_size * block_nbytes
    report = {
        "benchmark": "pd_transfer",
        "command": "python bench/scripts/pd_transfer.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_model_name(),
        "cpu_isa": isa_flags(),
        "model": "embedded SmolLM2-135M",
        "dtype": "bfloat16",
        "prompt_tokens": args.prompt_tokens,
        "prompts_per_repeat": args.prompts,
        "repeats": args.repeats,
        "median_ttft_s": median,
        "median_load_s_per_prompt": statistics.median(load_s),
        "prompt_kv_mib": kv_bytes / 2**20,
        "prefill_write_overhead": median["prefill"] / median["colocated"],
        "decode_ttft_vs_colocated": median["decode"] / median["colocated"],
        "all_ttft_s": times,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "all_ttft_s"}, indent=2))


if __name__ == "__main__":
    main()
