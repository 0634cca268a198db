"""Attention alone, AMX tiles against the AVX-512 dot products (the same kernel, switched with
tokenmill.ops.packed_gemm.set_amx): one step's paged attention over every layer of the SmolLM2-135M shape
(30 layers, 9 query heads on 3 kv heads of 64, a bf16 cache in blocks scattered through the pool).
Prompt chunks (`prefill`: sequences x chunk tokens, the whole context new) and decode rows (`decode`:
sequences x context tokens, one query row each). Median of 7 steps, paths alternated.

Usage: .venv/bin/python bench/scripts/attention_amx.py [--prefill 1x512 4x256] [--decode 32x300] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.ops import build, hugepages, packed_gemm

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def make_step(kernels: object, num_seqs: int, context: int, q_len: int) -> object:
    """A step of num_seqs sequences of `context` tokens, the last q_len of them queries."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = num_seqs * blocks_per_seq + 8
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * blocks_per_seq].view(num_seqs, -1).int()
    slots = (tables.long().unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).flatten()
    caches = []
    for _ in range(LAYERS):
        cache = hugepages.zeros((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.bfloat16)
        k, v = torch.randn(2, len(slots), KV_HEADS, HEAD_DIM, generator=gen)
        kernels.write_kv(k, v, cache, slots)  # type: ignore[attr-defined]
        caches.append(cache)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    q = torch.randn(num_seqs * q_len, HEADS, HEAD_DIM, generator=gen)
    starts = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)

    def step() -> None:
        for cache in caches:
            if q_len == 1:
                kernels.paged_decode(q, cache, tables, lens, HEAD_DIM**-0.5)  # type: ignore[attr-defined]
            else:
                kernels.paged_attention(q, cache, tables, lens, starts, HEAD_DIM**-0.5)  # type: ignore[attr-defined]

    return step


def timed(step: object, amx: bool) -> float:
    packed_gemm.set_amx(amx)
    step()  # type: ignore[operator]
    start = time.perf_counter()
    step()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", nargs="*", default=["1x512", "4x256", "8x128"])
    parser.add_argument("--decode", nargs="*", default=["1x300", "32x300"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = build.load("paged_decode")
    if kernels is None or not packed_gemm.set_amx(True):
        raise SystemExit("needs the AVX-512 kernels and a CPU with AMX-BF16")
    print(f"attention, {LAYERS} layers, {args.threads} threads, ms per step (median of 7)")
    print("| step | AVX-512 ms | AMX ms | AVX-512 / AMX |\n|---|---|---|---|")
    shapes = [("prefill", s) for s in args.prefill] + [("decode", s) for s in args.decode]
    for kind, shape in shapes:
        num_seqs, tokens = (int(x) for x in shape.split("x"))
        step = make_step(kernels, num_seqs, tokens, tokens if kind == "prefill" else 1)
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(7):
            for amx in (False, True):
                runs[amx].append(timed(step, amx))
        off, on = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"| {kind} {num_seqs} x {tokens} | {off * 1e3:.2f} | {on * 1e3:.2f} | {off / on:.2f}x |")
    packed_gemm.set_amx(True)


if __name__ == "__main__":
    main()
