"""The sampling kernels alone (tokenmill/ops/csrc/cpu_ops.h), against what torch does for the same picks: a
temperature draw (C++ sample_rows against softmax, a float64 cumsum and searchsorted) and greedy
(C++ argmax_rows against torch.argmax), on rows of SmolLM2's 49,152 logits. Median of 5 x 200 calls.

Usage: .venv/bin/python bench/scripts/sampling.py [--rows 1 8 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from tokenmill.ops.cpu_ops import cpu_ops

VOCAB = 49152


def ms_per_call(fn: Callable[[], object]) -> float:
    for _ in range(20):
        fn()
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            fn()
        timings.append((time.perf_counter() - start) / 200)
    return statistics.median(timings) * 1e3


def torch_draw(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    cdf = torch.softmax(logits / temperature.unsqueeze(1), dim=-1).double().cumsum(-1)  # [rows, vocab]
    return torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops(torch.zeros(1))
    if ops is None:
        raise SystemExit("the C++ CPU ops could not be built here")
    print(f"{VOCAB} logits a row, {args.threads} threads, ms per call (median of 5 x 200)")
    print("| rows | draw: C++ | draw: torch | greedy: C++ | greedy: torch.argmax |\n|---|---|---|---|---|")
    for rows in args.rows:
        gen = torch.Generator().manual_seed(rows)
        logits = torch.randn(rows, VOCAB, generator=gen) * 3  # [rows, vocab]
        temperature = torch.ones(rows)
        uniform = torch.rand(rows, dtype=torch.float64, generator=gen)
        cells = [
            ms_per_call(partial(ops.sample_rows, logits, temperature, uniform)),
            ms_per_call(partial(torch_draw, logits, temperature, uniform)),
            ms_per_call(partial(ops.argmax_rows, logits)),
            ms_per_call(partial(torch.argmax, logits, dim=-1)),
        ]
        print(f"| {rows} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
