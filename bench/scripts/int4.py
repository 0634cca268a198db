"""int4 weights on CPU (issue 31) against int8 and bf16, on the embedded model (SmolLM2-135M), one run:

- weights: resident bytes of the model's tensors (linear layers and head; all) per precision;
- decode at batch 1: `bench throughput` on fixed-128-1024 capped at 256 output tokens, 4 requests one at a
  time (decode_tok_s: the decode-only steps; output_tok_s: whole requests), RUNS runs each, interleaved;
- random-cpu: `bench throughput --workload random-cpu`, output tok/s;
- quality: `bench quality` (greedy agreement with bf16 over 20 prompts x 64 tokens, perplexity) for
  int4 in groups of 32 and 128 (and 32 with minimums); the embedded model is itself a Q4_1 file
  expanded, so also the logit error on the Qwen2.5-0.5B shape with random weights (against bf16:
  relative error of the logits at every position of 4 random 64-token prompts, top-1 agreement);
- llama.cpp (when `tokenmill bench setup-peer llamacpp` has run): `bench compare --dtype q4_0 / q4_1`
  at batch 1 and on random-cpu, tokenmill int4 (groups of 32; q4_1: with minimums) against llama.cpp
  on GGUF files quantized by llama.cpp itself from the same weights.

Usage: .venv/bin/python bench/scripts/int4.py [--out DIR] [--runs 2] [--skip quality,logits,llamacpp]
           [--speed-precisions "bf16,int8,int4 g32,gguf native"]
Writes DIR/summary.md and one JSON per run (default bench/results/int4).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path

PRECISIONS: dict[str, list[str]] = {
    "bf16": [],
    "int8": ["--quantization", "int8"],
    "int4 g32": ["--quantization", "int4"],
    "int4 g128": ["--quantization", "int4", "--quantization-group-size", "128"],
    "int4 g32 zp": ["--quantization", "int4", "--quantization-zero-point"],
    # the embedded GGUF's own blocks (Q4_1 layers, Q8_0 head), not quantized again from the bf16 expansion
    "gguf native": ["--quantization", "gguf"],
}
QUALITY = {name: flags for name, flags in PRECISIONS.items() if flags}
TOKENMILL = [sys.executable, "-c", "import sys; from tokenmill.cli import main; sys.argv[0] = 'tokenmill'; main()"]


def tokenmill(*args: str) -> str:
    proc = subprocess.run([*TOKENMILL, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"tokenmill {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def weight_bytes() -> list[str]:
    """Resident bytes of each precision's model tensors: those of the linear layers and head, and all."""
    import torch

    from tokenmill import LLM
    from tokenmill.quant import Bf16Linear, GroupedLinear, Int8Linear

    linear_kinds = (torch.nn.Linear, Bf16Linear, Int8Linear, GroupedLinear)
    rows = ["| precision | linear layers + head MB | all model tensors MB |", "|---|---|---|"]
    for name, flags in PRECISIONS.items():
        model = LLM(None, dtype="bfloat16", num_kv_blocks=16, **engine_kwargs(flags)).engine.runner.model
        # tensors counted once (a tied head is the embedding); by address, since the packed weights
        # are views into one huge-page buffer
        seen: set[tuple[int, int]] = set()
        total = linear = 0
        for module in model.modules():
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if (t.data_ptr(), t.numel()) in seen:
                    continue
                seen.add((t.data_ptr(), t.numel()))
                total += t.numel() * t.element_size()
                linear += t.numel() * t.element_size() if isinstance(module, linear_kinds) else 0
        rows.append(f"| {name} | {linear / 1e6:.1f} | {total / 1e6:.1f} |")
        del model
        gc.collect()
    return rows


def throughput(out: Path, name: str, flags: list[str], tag: str, workload_args: list[str]) -> dict[str, float]:
    path = out / f"{tag}-{name.replace(' ', '_')}.json"
    tokenmill("bench", "throughput", *workload_args, "--dtype", "bfloat16", *flags, "--output-json", str(path))
    return dict(json.loads(path.read_text())["results"])


def speed_tables(out: Path, runs: int, names: list[str]) -> list[str]:
    batch1 = ["--workload", "fixed-128-1024", "--max-output-len", "256", "--num-prompts", "4", "--max-num-seqs", "1"]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for run in range(runs):
        for name in names:  # interleaved: a slow minute hits every precision alike
            flags = PRECISIONS[name]
            for tag, args in (("b1", batch1), ("random-cpu", ["--workload", "random-cpu"])):
                results.setdefault((tag, name), []).append(throughput(out, name, flags, f"{tag}-r{run}", args))
                print(
                    f"{tag} {name} run {run}: {results[(tag, name)][-1]['output_tok_s']:.1f} output tok/s", flush=True
                )

    def median(tag: str, name: str, metric: str) -> float:
        return statistics.median(r[metric] for r in results[(tag, name)])

    rows = [
        "| precision | batch-1 decode tok/s | batch-1 output tok/s | random-cpu output tok/s | "
        "batch-1 decode vs int8 | random-cpu vs int8 |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        b1, b1_out, rc = (
            median("b1", name, "decode_tok_s"),
            median("b1", name, "output_tok_s"),
            median("random-cpu", name, "output_tok_s"),
        )
        rows.append(
            f"| {name} | {b1:.1f} | {b1_out:.1f} | {rc:.1f} | {b1 / median('b1', 'int8', 'decode_tok_s'):.2f}x | "
            f"{rc / median('random-cpu', 'int8', 'output_tok_s'):.2f}x |"
        )
    return rows


def quality_table() -> list[str]:
    rows = [
        "| precision | greedy agreement (to first divergence / overall) | perplexity | vs bf16 |",
        "|---|---|---|---|",
    ]
    for name, flags in QUALITY.items():
        text = tokenmill("bench", "quality", *flags)
        values = dict(line.strip().rsplit("  ", 1) for line in text.splitlines() if line.startswith("  "))
        values = {k.strip(): v.strip() for k, v in values.items()}
        ppl = next(v for k, v in values.items() if k.startswith("perplexity (") and "unquantized" not in k)
        rows.append(
            f"| {name} | {values['up to first divergence']} / {values['overall (same position)']} | {ppl} "
            f"(bf16 {values['perplexity (unquantized)']}) | {values['relative difference']} |"
        )
    return rows


def engine_kwargs(flags: list[str]) -> dict[str, object]:
    if not flags:
        return {}
    group_size = (
        int(flags[flags.index("--quantization-group-size") + 1]) if "--quantization-group-size" in flags else None
    )
    return {
        "quantization": flags[1],
        "quantization_group_size": group_size,
        "quantization_zero_point": "--quantization-zero-point" in flags,
    }


def logit_error_table(preset: str = "qwen2.5-0.5b") -> list[str]:
    """Each precision's logits against bf16's on `preset` with random weights (load_format dummy)."""
    import torch

    from tokenmill import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 50000, (64,), generator=gen).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logits_of(flags: list[str]) -> torch.Tensor:
        llm = LLM(preset, load_format="dummy", dtype="bfloat16", num_kv_blocks=64, **engine_kwargs(flags))
        model, captured = llm.engine.runner.model, []
        compute = model.compute_logits

        def capture(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute(hidden)
            captured.append(logits.float().clone())
            return logits

        model.compute_logits = capture
        for prompt in prompts:  # one at a time: the captured rows are the prompt's positions in order
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        del llm
        gc.collect()
        return torch.cat([c for c in captured if c.shape[0] > 1])  # [positions, vocab]: the prompt rows

    reference = logits_of([])
    rows = [f"| precision ({preset}, random weights) | logit error (relative) | top-1 agreement |", "|---|---|---|"]
    for name, flags in PRECISIONS.items():
        if not flags or "gguf" in flags:  # random weights have no GGUF file
            continue
        got = logits_of(flags)
        error = float((got - reference).norm() / reference.norm())
        agree = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
        rows.append(f"| {name} | {error:.4f} | {agree:.1%} |")
    return rows


def llamacpp_tables(out: Path) -> list[str]:
    from tokenmill.bench.peers import is_set_up

    if not is_set_up("llamacpp"):
        return ["llama.cpp: not set up here (run `tokenmill bench setup-peer llamacpp`, ~10 minutes); skipped."]
    rows = []
    batch1 = ["--workload", "fixed-128-1024", "--max-output-len", "256", "--num-prompts", "4", "--max-num-seqs", "1"]
    for tag, args in (("batch 1", batch1), ("random-cpu", ["--workload", "random-cpu"])):
        for dtype in ("q4_0", "q4_1"):
            path = out / f"compare-{tag.replace(' ', '')}-{dtype}.json"
            text = tokenmill(
                "bench", "compare", "--peers", "llamacpp", "--dtype", dtype, *args, "--output-json", str(path)
            )
            rows += [
                f"\n{tag}, {dtype} (tokenmill: int4 in groups of 32{', minimums' if dtype == 'q4_1' else ''}):",
                text,
            ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/int4"))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--speed-precisions",
        default=",".join(PRECISIONS),
        help=f"comma-separated, of: {', '.join(PRECISIONS)} (int8 is always in: the ratios are to it)",
    )
    parser.add_argument("--skip", default="", help="comma-separated: weights, speed, quality, logits, llamacpp")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    sections = []
    if "weights" not in skip:
        sections.append(("Resident weight bytes", weight_bytes()))
    if "speed" not in skip:
        names = [n.strip() for n in args.speed_precisions.split(",") if n.strip()]
        unknown = [n for n in names if n not in PRECISIONS]
        if unknown:
            parser.error(f"unknown precision(s) {unknown}; use {list(PRECISIONS)}")
        names = names if "int8" in names else ["int8", *names]
        sections.append(("Throughput (medians)", speed_tables(args.out, args.runs, names)))
    if "quality" not in skip:
        sections.append(("Quality against bf16", quality_table()))
    if "logits" not in skip:
        sections.append(("Logit error against bf16", logit_error_table()))
    if "llamacpp" not in skip:
        sections.append(("Against llama.cpp", llamacpp_tables(args.out)))
    text = "\n\n".join(f"## {title}\n\n" + "\n".join(rows) for title, rows in sections)
    (args.out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
