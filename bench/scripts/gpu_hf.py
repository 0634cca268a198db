"""HF transformers `generate` on a GPU, on the requests `tokenmill bench throughput` makes for the same
workload, model preset (random weights) and --num-prompts: the peer a GPU user starts from.

Static batches of --batch-size requests sorted by output length (what favours HF: less is generated only
to be thrown away), each left-padded and run to its longest output (`min_new_tokens`, so no early end);
tokens past a request's own output length are not counted. Sampling at the workload's temperature.

Usage: python bench/scripts/gpu_hf.py --model qwen3-0.6b --workload random-gpu --num-prompts 64 \
           --batch-size 64 --output-json hf.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from tokenmill.bench.datasets import BenchRequest, make_workload
from tokenmill.loader.presets import PRESETS, preset_config


@torch.inference_mode()
def generate_batch(model: torch.nn.Module, batch: list[BenchRequest], device: str) -> int:
    """Run one static batch; returns the output tokens it counts (each request's own length)."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)  # [batch, width], left-padded with 0
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids) :] = 1
    new = max(r.output_len for r in batch)
    temperature = batch[0].temperature
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
    out = model.generate(  # type: ignore[operator]
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
        **sampling,
    )
    assert out.shape[1] == width + new
    return sum(r.output_len for r in batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(PRESETS))
    parser.add_argument("--workload", default="random-gpu")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, required=True)
    args = parser.parse_args()

    config = preset_config(args.model)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    with torch.device(args.device):  # random weights drawn on the GPU
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    startup_s = time.perf_counter() - start
    requests = make_workload(
        args.workload,
        config.vocab_size,
        seed=args.seed,
        num_requests=args.num_prompts,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
    )
    requests.sort(key=lambda r: (r.output_len, len(r.prompt_token_ids)))
    batches = [requests[i : i + args.batch_size] for i in range(0, len(requests), args.batch_size)]
    generate_batch(model, [BenchRequest([7, 8, 9], 4, requests[0].temperature)] * 2, args.device)  # warm-up
    on_cuda = args.device.startswith("cuda")
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    output_tokens = sum(generate_batch(model, batch, args.device) for batch in batches)
    if on_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    result = {
        "engine": "hf",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if on_cuda else None,
        "model": args.model,
        "dtype": args.dtype,
        "workload": args.workload,
        "num_requests": len(requests),
        "batch_size": args.batch_size,
        "startup_s": startup_s,
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
    }
    print(json.dumps(result, indent=2))
    args.output_json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
