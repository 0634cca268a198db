"""Command line: tokenmill generate | chat | serve | bench throughput."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from tokenmill.config import KV_CACHE_DTYPES, EngineArgs

EXAMPLE_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a GPU is in one sentence.",
    "List three prime numbers.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (names as in vLLM)."""
    d = EngineArgs()
    parser.add_argument("--model", default=None, help="HF folder, .gguf file or preset (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default=d.dtype, help="auto | bfloat16 | float32 | float16")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                        help="what the KV cache stores; auto: bf16 on a CPU running bf16 or int8 weights, "
                             "else the model's dtype; int8 (CPU with AVX-512 BF16): per-token scales, half of bf16")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb)
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="CUDA: share of the GPU's memory for weights, activations and KV cache")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--load-format", default=d.load_format, help="auto | safetensors | gguf | dummy")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--attention-backend", default=d.attention_backend)
    parser.add_argument("--scheduling-policy", default=d.scheduling_policy, help="fcfs | priority")
    parser.add_argument("--quantization", default=d.quantization,
                        help="int8: per-channel int8 weights quantized at load (default: none)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every layer from Python: no CUDA graphs, no fused CPU decode stack")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = [f for f in EngineArgs.__dataclass_fields__ if f != "model"]
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def cmd_generate(args: argparse.Namespace) -> None:
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
    prompts = args.prompts or EXAMPLE_PROMPTS
    start = time.perf_counter()
    if args.raw or llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {num_in} prompt + {num_out} generated tokens in {elapsed:.2f} s: "
          f"{num_out / elapsed:.1f} output tok/s")


def cmd_chat(args: argparse.Namespace) -> None:
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
    history: list[dict[str, str]] = []
    print("tokenmill chat: type a message, an empty line or Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        reply = ""
        for out in llm.stream(history, params, chat=True):
            print(out.outputs[0].delta_text, end="", flush=True)
            reply += out.outputs[0].delta_text
        print()
        history.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="tokenmill", description="A high-throughput LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate for prompts (default: a few examples)")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--raw", action="store_true", help="no chat template, plain completion")
    gen.add_argument("prompts", nargs="*")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive streaming chat")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from tokenmill.server.cli import add_serve_parser

    add_serve_parser(sub)

    from tokenmill.bench.cli import add_bench_parser

    add_bench_parser(sub)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, RuntimeError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
