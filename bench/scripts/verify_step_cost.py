"""What a speculative decoding verification step costs: the model forward of one request feeding 1 + k
query tokens after a context of `--context` tokens, on the default model, through the fused C++ decode
stack and layer by layer from Python, interleaved in one process (this machine drifts between runs).
At batch 1 a step streams every weight once whatever its query length, so a short query should cost
little more than one token.

Usage: .venv/bin/python bench/scripts/verify_step_cost.py [--quantization int8] [--query-lens 1 2 3 5 9]
       [--context 300] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tokenmill import LLM
from tokenmill.attention.metadata import AttentionMetadata

BLOCK = 16


def verify_inputs(llm: LLM, context: int, query_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One request's step: query_len tokens after `context` computed ones, its blocks scattered over the pool."""
    pool = llm.engine.runner.kv_caches[0].shape[1]
    seq_len = context + query_len
    blocks = torch.randperm(pool, generator=torch.Generator().manual_seed(0))[: -(-seq_len // BLOCK)]
    table = blocks.to(torch.int32).view(1, -1)  # [1, blocks]
    positions = torch.arange(context, seq_len)  # [query_len]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=table,
        slot_mapping=table[0, positions // BLOCK].long() * BLOCK + positions % BLOCK,
        query_start_loc_cpu=[0, query_len],
        seq_lens_cpu=[seq_len],
        max_query_len=query_len,
        max_seq_len=seq_len,
    )
    return torch.arange(query_len) + 1000, positions, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default=None, choices=[None, "int8"])
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--query-lens", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    llm = LLM(dtype="bfloat16", quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=1)
    runner = llm.engine.runner
    fused = runner.fused_decode
    if fused is None:
        raise SystemExit(f"no fused decode stack here: {runner.fused_decode_off_reason}")
    paths: dict[str, Callable[..., torch.Tensor]] = {"fused": fused, "layer by layer": runner.model}
    steps = {n: verify_inputs(llm, args.context, n) for n in args.query_lens}
    times: dict[tuple[str, int], list[float]] = {(p, n): [] for p in paths for n in steps}
    with torch.inference_mode():
        for path in paths.values():  # warm-up: binds the stack, builds the kernels' buffers
            for inputs in steps.values():
                path(*inputs)
        for _ in range(args.rounds):
            for n, inputs in steps.items():
                for name, path in paths.items():
                    for _ in range(5):
                        start = time.perf_counter()
                        path(*inputs)
                        times[name, n].append(time.perf_counter() - start)
    ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    one = ms["fused", args.query_lens[0]]
    print(
        f"{args.quantization or 'bf16'} weights, {runner.kv_caches[0].dtype} KV cache, batch 1, context "
        f"{args.context}, {torch.get_num_threads()} threads: model forward ms (median of {args.rounds} x 5 "
        f"steps, interleaved; one region: {fused._stack.one_region})"
    )
    print(f"| query tokens | fused ms | vs {args.query_lens[0]} token | layer by layer ms |\n|---|---|---|---|")
    for n in steps:
        print(f"| {n} | {ms['fused', n]:.2f} | {ms['fused', n] / one:.2f}x | {ms['layer by layer', n]:.2f} |")


if __name__ == "__main__":
    main()
