"""Embeddings throughput (issue 46): texts/s of tokenmill's LLM.embed against HF transformers on the same model.

Usage: .venv/bin/python bench/scripts/embeddings_vs_hf.py [--texts 256] [--dtype bfloat16]
           [--output bench/results/xeon-amx/embeddings.json]

The embedded default model (SmolLM2-135M-Instruct, through tokenmill's default-model loader) embeds --texts
texts of 64-128 tokens (slices of tokenmill's bench corpus), last-token pooling, L2-normalized, in --dtype.
tokenmill: one LLM.embed call (its scheduler packs the prompts into steps of max_num_batched_tokens, 4096 here).
HF: AutoModel in the same dtype, texts sorted by length (least padding), right-padded batches of each size in
--hf-batch-sizes, the last real token's hidden state; the best batch size is quoted. Both after a warm-up
run, on the same torch threads; the median of --repeats timed runs. The two sets of embeddings are compared
(the lowest cosine similarity between a text's two embeddings) so the speed is for the same result.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill import LLM
from tokenmill.loader.default_model import default_model_path

CORPUS = Path(__file__).resolve().parents[2] / "tokenmill" / "bench" / "data" / "copy_edit.txt"


def make_texts(tokenizer: Any, n: int, seed: int = 0) -> list[list[int]]:
    """n token-id slices of the corpus, each 64-128 tokens long."""
    ids = tokenizer.encode(CORPUS.read_text())
    gen = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(n):
        length = int(torch.randint(64, 129, (1,), generator=gen))
        start = int(torch.randint(0, len(ids) - length, (1,), generator=gen))
        texts.append(ids[start : start + length])
    return texts


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    fn()  # warm-up: kernels, packed weights, allocator
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


@torch.inference_mode()
def hf_embed(model: Any, texts: list[list[int]], batch_size: int) -> torch.Tensor:
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.empty(len(texts), model.config.hidden_size)
    for b in range(0, len(order), batch_size):
        rows = order[b : b + batch_size]
        width = max(len(texts[i]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for r, i in enumerate(rows):
            ids[r, : len(texts[i])] = torch.tensor(texts[i])
            mask[r, : len(texts[i])] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [batch, width, hidden]
        last = hidden[torch.arange(len(rows)), mask.sum(dim=1) - 1].float()
        out[rows] = F.normalize(last, dim=-1)
    return out


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-batch-sizes", default="16,64")
    parser.add_argument("--output", default="bench/results/xeon-amx/embeddings.json")
    args = parser.parse_args()

    folder = default_model_path()
    llm = LLM(str(folder), dtype=args.dtype, max_num_batched_tokens=4096, max_num_seqs=256)
    texts = make_texts(llm.get_tokenizer(), args.texts)
    num_tokens = sum(len(t) for t in texts)
    tm_s, tm_out = timed(lambda: llm.embed([list(t) for t in texts]), args.repeats)
    tokenmill_vectors = torch.tensor([o.embedding for o in tm_out])
    print(f"tokenmill: {args.texts / tm_s:.1f} texts/s ({num_tokens / tm_s:.0f} tok/s)", flush=True)

    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    hf: dict[str, dict[str, float]] = {}
    hf_vectors = None
    for batch_size in [int(b) for b in args.hf_batch_sizes.split(",")]:
        seconds, hf_vectors = timed(lambda b=batch_size: hf_embed(model, texts, b), args.repeats)
        hf[str(batch_size)] = {"seconds": seconds, "texts_per_s": args.texts / seconds}
        print(f"HF batch {batch_size}: {args.texts / seconds:.1f} texts/s", flush=True)
    best = max(hf.values(), key=lambda r: r["texts_per_s"])
    assert hf_vectors is not None
    agreement = float((tokenmill_vectors * hf_vectors).sum(dim=1).min())
    result = {
        "benchmark": "embeddings texts/s, tokenmill LLM.embed vs HF transformers AutoModel (issue 46)",
        "command": "python bench/scripts/embeddings_vs_hf.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "cpu": cpu_name(),
        "cpu_has_amx": "amx_tile" in Path("/proc/cpuinfo").read_text(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (tokenmill's default model, bf16 safetensors)",
        "dtype": args.dtype,
        "pooling": "last token, L2-normalized",
        "num_texts": args.texts,
        "num_tokens": num_tokens,
        "tokenmill": {"seconds": tm_s, "texts_per_s": args.texts / tm_s, "max_num_batched_tokens": 4096},
        "hf_by_batch_size": hf,
        "hf_best_texts_per_s": best["texts_per_s"],
        "ratio_tokenmill_over_hf": (args.texts / tm_s) / best["texts_per_s"],
        "min_cosine_tokenmill_vs_hf": agreement,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
