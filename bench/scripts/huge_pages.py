"""Decode steps with the packed weights and KV cache on huge pages (the default, tokenmill/ops/hugepages.py)
against the same engine moved back onto 4 KiB pages, interleaved in one process (this machine drifts by
10-25% between runs). Each step is the model forward of `rows` decode rows (the C++ decode stack),
contexts of `--context` tokens in blocks scattered through the pool.

Usage: .venv/bin/python bench/scripts/huge_pages.py [--quantization int8] [--rows 1 4 8] [--context 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from tokenmill import LLM
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.quant import Bf16Linear, Int8Linear


def onto_small_pages(llm: LLM) -> None:
    """Copy the packed weights and KV caches onto ordinary allocations (4 KiB pages where the kernel's
    huge pages are madvise-only); the fused stack rebinds to the new caches on its next call."""
    runner = llm.engine.runner
    for module in runner.model.modules():
        if isinstance(module, (Bf16Linear, Int8Linear)):
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.clone())
    runner.kv_caches = [torch.zeros_like(c) for c in runner.kv_caches]
    for layer, cache in zip(runner.model.layers, runner.kv_caches):
        layer.self_attn.kv_cache = cache


def decode_inputs(llm: LLM, rows: int, context: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    pool = llm.engine.runner.kv_caches[0].shape[1]
    per_seq = -(-context // 16)
    tables = torch.randperm(pool, generator=torch.Generator().manual_seed(0))[: rows * per_seq]
    tables = tables.to(torch.int32).view(rows, per_seq)  # [rows, blocks per sequence]
    meta = AttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.full((rows,), context, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=tables[:, -1].long() * 16 + (context - 1) % 16,
        query_start_loc_cpu=list(range(rows + 1)),
        seq_lens_cpu=[context] * rows,
        max_query_len=1,
        max_seq_len=context,
    )
    return torch.arange(rows) + 1000, torch.full((rows,), context - 1), meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default=None, choices=[None, "int8"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    kv = "int8" if args.quantization == "int8" else "auto"
    engines: dict[str, Any] = {}
    for pages in ("huge", "4k"):
        llm = LLM(dtype="bfloat16", quantization=args.quantization, kv_cache_dtype=kv, max_num_seqs=max(args.rows))
        if pages == "4k":
            onto_small_pages(llm)
        engines[pages] = llm
    print(
        f"{args.quantization or 'bf16'} weights, {kv} KV cache, context {args.context}: model forward ms "
        f"(median of {args.rounds} x 10 steps per setting, interleaved)"
    )
    print("| rows | huge pages ms | 4 KiB pages ms | speedup |\n|---|---|---|---|")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {p: decode_inputs(llm, rows, args.context) for p, llm in engines.items()}
            times: dict[str, list[float]] = {p: [] for p in engines}
            for _ in range(args.rounds):
                for pages, llm in engines.items():
                    model = llm.engine.runner.model
                    for _ in range(10):
                        start = time.perf_counter()
                        model(*inputs[pages])
                        times[pages].append(time.perf_counter() - start)
            huge, small = (statistics.median(times[p]) for p in ("huge", "4k"))
            print(f"| {rows} | {huge * 1e3:.2f} | {small * 1e3:.2f} | {small / huge:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
