"""Decode attention alone: one step's paged attention over every layer of the SmolLM2-135M shape (30
layers, 9 query heads on 3 kv heads of 64), contexts in blocks scattered through the pool as a
long-running server's are, the caches on huge pages as the engine allocates them. Before each timed
step a 256 MiB read evicts the caches, as a decode step's weight stream does in the engine (--warm: no
eviction; an int8 cache of 8 x 256 tokens, 24 MB, then sits in L3). Median of 9 steps per cache dtype.
With the AVX-512 kernel, a bf16 against an int8 cache; on an AVX2 build (TOKENMILL_CPU_ISA=avx2, or an
AVX2-only CPU) the bf16 cache alone, through the portable kernel, with the rate it reads the cache at.

Usage: .venv/bin/python bench/scripts/decode_attention.py [--shapes 1x300 8x250 32x200] [--threads 2] [--warm]
(each shape: sequences x context tokens)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.attention.pair_layout import cache_row_width
from tokenmill.ops import build, hugepages

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def step_seconds(
    kernels: object, num_seqs: int, context: int, cache_dtype: torch.dtype, evict: torch.Tensor | None, pairs: bool
) -> float:
    """pairs: the AVX-512 kernel's cache layout (written by write_kv, read by paged_attention), else
    the plain one paged_decode reads."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = num_seqs * blocks_per_seq + 8
    width = cache_row_width(
        HEAD_DIM, "int8" if cache_dtype == torch.int8 else "bfloat16"
    )  # int8 rows carry their scale
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * blocks_per_seq].view(num_seqs, -1).int()
    slots = (tables.long().unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).flatten()  # every slot of every table
    caches = []
    for _ in range(LAYERS):
        cache = hugepages.zeros((2, num_blocks, BLOCK, KV_HEADS, width), cache_dtype)
        k, v = torch.randn(2, len(slots), KV_HEADS, HEAD_DIM, generator=gen)
        if pairs:
            kernels.write_kv(k, v, cache, slots)  # type: ignore[attr-defined]
        else:
            cache.view(2, -1, KV_HEADS, width)[:, slots] = torch.stack([k, v]).to(cache_dtype)
        caches.append(cache)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen)

    def one_step() -> None:
        for cache in caches:
            kernels.paged_decode(q, cache, tables, lens, HEAD_DIM**-0.5)  # type: ignore[attr-defined]

    one_step()
    timings = []
    for _ in range(9):
        if evict is not None:
            evict.sum()
        start = time.perf_counter()
        one_step()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x300", "8x250", "32x200", "32x360"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warm", action="store_true", help="no cache eviction between steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = build.load("paged_decode")
    if kernels is None:
        raise SystemExit("the C++ attention kernels did not build here")
    probe = torch.zeros(2, 1, BLOCK, KV_HEADS, cache_row_width(HEAD_DIM, "int8"), dtype=torch.int8)
    pairs = bool(kernels.avx512_supports(probe))
    evict = None if args.warm else torch.ones(64 << 20)  # [64 Mi] float32: 256 MiB
    caches_note = "warm caches" if args.warm else "caches evicted before each step"
    kernel_note = "AVX-512 kernel" if pairs else "portable (AVX2) kernel"
    print(f"decode attention, {kernel_note}, {LAYERS} layers, {args.threads} threads, {caches_note}, ms per step")
    if pairs:
        print("| sequences x context | bf16 cache ms | int8 cache ms | bf16 / int8 |\n|---|---|---|---|")
    else:  # only the AVX-512 kernel reads an int8 cache
        print("| sequences x context | bf16 cache ms | cache read GB/s |\n|---|---|---|")
    for shape in args.shapes:
        num_seqs, context = (int(x) for x in shape.split("x"))
        bf16 = step_seconds(kernels, num_seqs, context, torch.bfloat16, evict, pairs)
        if pairs:
            int8 = step_seconds(kernels, num_seqs, context, torch.int8, evict, pairs)
            print(f"| {num_seqs} x {context} | {bf16 * 1e3:.2f} | {int8 * 1e3:.2f} | {bf16 / int8:.2f}x |")
        else:
            cache_bytes = LAYERS * num_seqs * context * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
            print(f"| {num_seqs} x {context} | {bf16 * 1e3:.2f} | {cache_bytes / bf16 / 1e9:.1f} |")


if __name__ == "__main__":
    main()
