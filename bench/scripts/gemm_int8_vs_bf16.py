"""The GEMMs alone, int8 against bf16 packed weights, at 1-16 rows: the ceiling of the end-to-end
int8 / bf16 decode ratio (bench/scripts/int8_vs_bf16.sh), since the rest of a step costs both the same.

Every linear layer of the model's 30 decoder layers (distinct weights, ~106 MB int8 / ~213 MB bf16:
streamed from memory as in decode) and the LM head, best of 7 passes.
Usage: .venv/bin/python bench/scripts/gemm_int8_vs_bf16.py [--rows 1 2 4 8 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.bench.roofline import ModelShape
from tokenmill.loader.presets import PRESETS
from tokenmill.ops import packed_gemm
from tokenmill.quant import Bf16Linear
from tokenmill.quant.int8 import Int8Linear


def layers_of(shape: ModelShape, precision: str) -> list[torch.nn.Module]:
    gen = torch.Generator().manual_seed(0)
    made = []
    for out_features, in_features, count in shape.linear_shapes():
        for _ in range(count):
            w = torch.randn(out_features, in_features, generator=gen) * 0.02
            made.append(Bf16Linear(w, None) if precision == "bf16" else Int8Linear.from_weight(w, None, kernel="cpu"))
    return made


def seconds_per_pass(layers: list[torch.nn.Module], rows: int, passes: int = 7) -> float:
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}  # [rows, in_features]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(passes + 1):  # the first pass warms up
            start = time.perf_counter()
            for m in layers:
                m(inputs[m.in_features])
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not packed_gemm.available():
        raise SystemExit("the C++ packed GEMM could not be built here")
    torch.set_num_threads(args.threads)
    shape = ModelShape.from_hf_config(PRESETS[args.preset])
    layers = {p: layers_of(shape, p) for p in ("bf16", "int8")}
    print(f"{args.preset}, {args.threads} threads: all linear layers of one forward pass, ms (best of 7)")
    print("| rows | bf16 ms | int8 ms | int8 / bf16 speed |\n|---|---|---|---|")
    for rows in args.rows:
        bf16, int8 = (seconds_per_pass(layers[p], rows) for p in ("bf16", "int8"))
        print(f"| {rows} | {bf16 * 1e3:.2f} | {int8 * 1e3:.2f} | {bf16 / int8:.2f}x |")


if __name__ == "__main__":
    main()
