"""LoRA adapters batched together (issue 50): output throughput with 1, 4 and 16 adapters active at once,
of rank 8 and 64, against the base model alone, on the `random-cpu` workload.

Usage: .venv/bin/python bench/scripts/lora_throughput.py [--num-prompts 32] [--repeat 2] [--ranks 8 64]
           [--adapters 1 4 16] [--dtype bfloat16] [--output bench/results/xeon-amx/lora_throughput.json]

The embedded default model (SmolLM2-135M). Adapters are written in PEFT's format (adapter_config.json,
adapter_model.safetensors) with random A and B on every target module (q/k/v/o, gate/up/down), so each
one changes the output. The requests are assigned to the adapters round-robin; every adapter is resident
at once (--max-loras = the adapter count, --max-lora-rank = the rank). The base runs on an engine without
--enable-lora. Configurations alternate within each repeat; each is a fresh LLM, warmed up; the median
of the repeats is reported, with each configuration's ratio to the base's median and the memory of one
resident adapter slot.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokenmill import LLM
from tokenmill.bench.datasets import make_workload
from tokenmill.bench.hardware_info import cpu_model_name, isa_flags
from tokenmill.bench.throughput import run_throughput
from tokenmill.lora import LoRARequest
from tokenmill.lora.adapter import TARGET_MODULES, module_shapes


def write_adapter(folder: Path, hf_config: Any, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of `rank` on every target module, random A and B (PEFT's own start has B = 0)."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (out_features, in_features) in module_shapes(hf_config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def measure(args: argparse.Namespace, adapters: list[LoRARequest], rank: int) -> tuple[float, int | None]:
    """Output tok/s of the workload on a fresh engine (adapters round-robin; none: the base model), and
    the bytes of one resident adapter slot."""
    kwargs: dict[str, Any] = {"dtype": args.dtype, "max_num_seqs": args.num_prompts}
    if adapters:
        kwargs |= {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": rank}
    with LLM(**kwargs) as llm:
        requests = make_workload("random-cpu", vocab_size=llm.config.model.vocab_size, seed=0)[: args.num_prompts]
        loras = [adapters[i % len(adapters)] for i in range(len(requests))] if adapters else None
        result = run_throughput(llm, requests, lora_requests=loras)
        slots = llm.engine.runner.loras
        return result.output_tok_s, slots.nbytes_per_slot if slots is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with LLM(dtype=args.dtype) as llm:  # only for its config
            hf_config = llm.config.model.hf_config
        pools = {
            rank: [
                LoRARequest(f"r{rank}-{i}", 1 + i, str(write_adapter(Path(tmp) / f"r{rank}-{i}", hf_config, rank, i)))
                for i in range(max(args.adapters))
            ]
            for rank in args.ranks
        }
        configs = [("base", 0, 0)] + [(f"{n}x r{rank}", n, rank) for rank in args.ranks for n in args.adapters]
        runs: dict[str, list[float]] = {name: [] for name, _, _ in configs}
        slot_bytes: dict[int, int] = {}
        for repeat in range(args.repeat):
            for name, n, rank in configs:
                tok_s, nbytes = measure(args, pools[rank][:n] if n else [], rank)
                runs[name].append(tok_s)
                if nbytes is not None:
                    slot_bytes[rank] = nbytes
                print(f"repeat {repeat + 1}: {name}: {tok_s:.1f} output tok/s", flush=True)
    base = statistics.median(runs["base"])
    table = {
        name: {
            "output_tok_s": runs[name],
            "median": statistics.median(runs[name]),
            "vs_base": statistics.median(runs[name]) / base,
        }
        for name, _, _ in configs
    }
    for name, row in table.items():
        print(f"{name:>10}: {row['median']:7.1f} output tok/s  {row['vs_base']:.2f}x base")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "benchmark": "lora_throughput",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "cpu": cpu_model_name(),
        "cpu_isa": [flag for flag, on in isa_flags().items() if on],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "model": "embedded SmolLM2-135M",
        "workload": f"random-cpu, {args.num_prompts} requests, all at once",
        "dtype": args.dtype,
        "results": table,
        "adapter_slot_mib": {str(rank): nbytes / 2**20 for rank, nbytes in slot_bytes.items()},
    }
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
