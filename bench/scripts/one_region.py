"""Decode steps with every op of the C++ decode stack in one parallel region (the default where the
AVX-512 kernels serve every layer) against one parallel region per op, on the same engine, interleaved
in one process (this machine drifts by 10-25% between runs). Each step is the model forward of `rows`
decode rows, contexts of `--context` tokens in blocks scattered through the pool (huge_pages.py).

Usage: .venv/bin/python bench/scripts/one_region.py [--quantization int8] [--rows 1 4 8 32] [--context 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from huge_pages import decode_inputs  # bench/scripts/ is on sys.path when run as a script

from tokenmill import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default=None, choices=[None, "int8"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    kv = "int8" if args.quantization == "int8" else "auto"
    llm = LLM(dtype="bfloat16", quantization=args.quantization, kv_cache_dtype=kv, max_num_seqs=max(args.rows))
    fused = llm.engine.runner.fused_decode
    if fused is None:
        raise SystemExit(f"no fused decode stack here: {llm.engine.runner.fused_decode_off_reason}")
    print(
        f"{args.quantization or 'bf16'} weights, {kv} KV cache, context {args.context}: model forward ms "
        f"(median of {args.rounds} x 10 steps per setting, interleaved)"
    )
    print("| rows | one region ms | a region per op ms | speedup |\n|---|---|---|---|")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = decode_inputs(llm, rows, args.context)
            fused(*inputs)  # binds the stack
            stack = fused._stack
            if not stack.one_region:
                raise SystemExit("the decode stack does not run in one region here (no AVX-512 kernels?)")
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for one_region in (True, False):
                    stack.one_region = one_region
                    for _ in range(10):
                        start = time.perf_counter()
                        fused(*inputs)
                        times[one_region].append(time.perf_counter() - start)
            stack.one_region = True
            one, per_op = (statistics.median(times[k]) for k in (True, False))
            print(f"| {rows} | {one * 1e3:.2f} | {per_op * 1e3:.2f} | {per_op / one:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
