"""A mixture-of-experts model on CPU against llama.cpp (issue 45): Granite-3.1-1B-A400M's shape (24 layers,
32 experts of 512, top 8, hidden 1024) with random weights, one HF folder (the `granite-3.1-1b-a400m`
preset) for both engines; llama.cpp runs the GGUF its own converter writes from that folder (Q8_0
directly, Q4_0 quantized by llama.cpp from the f32 file: tokenmill/bench/peers/llamacpp.py).

For int8 (tokenmill --quantization int8 against Q8_0) and 4-bit (tokenmill --quantization int4, groups of
32, against Q4_0): `tokenmill bench compare --peers llamacpp` at batch 1 (4 requests one at a time) and
at 32 concurrent requests, 128-token prompts, OUTPUT generated tokens each (ignore_eos), the median of
REPEAT runs per engine. Writes one compare JSON per case under bench/results/xeon-amx/moe/ and the summary
(output tok/s of both engines and the ratio per case, with the command) to
bench/results/xeon-amx/moe-vs-llamacpp.json.

Usage: .venv/bin/python bench/scripts/moe_vs_llamacpp.py [--repeat 1] [--output-len 64]
Needs `tokenmill bench setup-peer llamacpp` once. Run alone on the machine (other work skews both engines).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "xeon-amx"
PRESET = "granite-3.1-1b-a400m"
DTYPES = {"int8": "int8 (Q8_0 for llama.cpp)", "q4_0": "4-bit: int4 groups of 32 (Q4_0 for llama.cpp)"}
BATCHES = {"batch1": (4, 1), "32-requests": (32, 32)}  # name -> (requests, concurrent sequences)
# llama.cpp's AMX weight buffers crash llama_decode on any batch of more than one token on this machine
# (ggml_backend_amx_mul_mat, SmolLM2 too), so it runs as with --no-repack: its AVX-512 VNNI kernels.
LLAMACPP_OPTIONS = {"extra_bufts": False}


def compare(dtype: str, requests: int, seqs: int, output_len: int, repeat: int, path: Path) -> dict[str, object]:
    """One `bench compare` case (as `tokenmill bench compare --model PRESET --peers llamacpp --workload
    fixed-128-1024 ...` runs it), llama.cpp without its extra buffer types (see LLAMACPP_OPTIONS)."""
    from tokenmill.bench.compare import CompareOptions, format_table, run_compare
    from tokenmill.bench.report import machine_info

    opts = CompareOptions(
        workload="fixed-128-1024",
        peers=["llamacpp"],
        model=PRESET,
        dtype=dtype,
        num_prompts=requests,
        max_output_len=output_len,
        repeat=repeat,
        max_num_seqs=seqs,
        engine_options={"llamacpp": LLAMACPP_OPTIONS},
    )
    report = run_compare(opts)
    print(format_table(report), flush=True)
    data = {"machine": machine_info(), **report.to_dict()}
    path.write_text(json.dumps(data, indent=2) + "\n")
    engines = {e["engine"]: e for e in data["engines"]}
    ours, peer = engines["tokenmill"], engines.get("llamacpp", {})
    ours_tok_s, peer_tok_s = ours.get("output_tok_s"), peer.get("output_tok_s")
    return {
        "requests": requests,
        "concurrent": seqs,
        "tokenmill_output_tok_s": ours_tok_s,
        "llamacpp_output_tok_s": peer_tok_s,
        "llamacpp_status": peer.get("status"),
        "ratio": ours_tok_s / peer_tok_s if ours_tok_s and peer_tok_s else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "moe-vs-llamacpp.json")
    opts = parser.parse_args()
    cases_dir = opts.out.parent / "moe"
    cases_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    cases: dict[str, dict[str, object]] = {}
    for dtype in DTYPES:
        for batch, (requests, seqs) in BATCHES.items():
            name = f"{dtype}-{batch}"
            cases[name] = compare(dtype, requests, seqs, opts.output_len, opts.repeat, cases_dir / f"{name}.json")
            print(f"{name}: {cases[name]}", flush=True)
    summary = {
        "command": f".venv/bin/python bench/scripts/moe_vs_llamacpp.py --repeat {opts.repeat} "
        f"--output-len {opts.output_len}",
        "model": f"{PRESET} (GraniteMoeForCausalLM, random weights)",
        "dtypes": DTYPES,
        "machine": {"cpu": _cpu_model(), "cores": _cores(), "isa": _isa(), "platform": platform.platform()},
        "wall_s": round(time.time() - started),
        "cases": cases,
    }
    opts.out.write_text(json.dumps(summary, indent=2) + "\n")
    print("\n| case | tokenmill out tok/s | llama.cpp out tok/s | ratio |\n|---|---|---|---|")
    for name, case in cases.items():
        ours, peer, ratio = case["tokenmill_output_tok_s"], case["llamacpp_output_tok_s"], case["ratio"]
        print(f"| {name} | {ours:.1f} | {peer:.1f} | {ratio:.2f}x |" if ratio else f"| {name} | {ours} | {peer} | - |")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _isa() -> str:
    flags = {
        w for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags") for w in line.split()
    }
    if {"amx_bf16", "amx_int8"} <= flags:
        return "AVX-512 (BF16, VNNI) with AMX (amx_bf16, amx_int8)"
    return "AVX-512 (BF16, VNNI)" if "avx512_bf16" in flags else "AVX2"


if __name__ == "__main__":
    main()
