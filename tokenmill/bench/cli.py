"""`tokenmill bench <subcommand>`: benchmarks from the command line.

    tokenmill bench throughput --workload random-cpu --dtype bfloat16 --output-json results.json
    tokenmill bench throughput --workload random-cpu --cost-per-hour 2.5   # also $ per 1M tokens
    tokenmill bench throughput --workload random-cpu --static-batching --max-num-seqs 16
    tokenmill bench throughput --workload copy-edit --max-num-seqs 1 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --output-json spec.json
    tokenmill bench setup-peer llamacpp
    tokenmill bench compare --workload random-cpu --peers vllm,llamacpp,ct2,hf --repeat 3 --plot compare.png
    tokenmill bench serve --base-url http://127.0.0.1:8000 --workload random-cpu --request-rate inf
    tokenmill bench quality --quantization int8
    tokenmill bench calibrate --workload random-cpu --output-json profile.json   # for tokenmill plan --profile

Each subcommand registers itself in `add_bench_parser`; `bench` has its own subparsers so more
(serve, compare) can be added beside `throughput`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.bench.datasets import WORKLOADS
from tokenmill.bench.report import add_cost_arg, cost_report, format_cost, machine_info

if TYPE_CHECKING:
    from tokenmill.bench.throughput import ThroughputResult
    from tokenmill.engine.llm import LLM


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` (with its own subcommands) to the top-level `tokenmill` subparsers."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks: throughput, serve, compare, setup-peer, quality, calibrate"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_throughput_parser(bench_sub)
    from tokenmill.bench.quality import add_quality_parser

    add_quality_parser(bench_sub)
    from tokenmill.bench.compare_cli import add_compare_parser, add_setup_peer_parser

    add_compare_parser(bench_sub)
    add_setup_peer_parser(bench_sub)
    from tokenmill.bench.serve import add_serve_parser

    add_serve_parser(bench_sub)
    from tokenmill.bench.calibrate import add_calibrate_parser

    add_calibrate_parser(bench_sub)
    return bench


def _add_throughput_parser(subparsers: argparse._SubParsersAction) -> None:
    from tokenmill.engine.engine_args import add_engine_args

    workloads = "; ".join(f"{w.name}: {w.num_requests} requests, {w.description}" for w in WORKLOADS.values())
    parser = subparsers.add_parser(
        "throughput",
        help="offline throughput of a standard workload (--seed also seeds the workload)",
        description=f"Offline throughput of a standard workload. Workloads: {workloads}.",
    )
    add_engine_args(parser)
    parser.add_argument("--workload", default="random-cpu", choices=list(WORKLOADS))
    parser.add_argument("--num-prompts", type=int, default=None, help="override the workload's request count")
    parser.add_argument(
        "--max-prompt-len",
        type=int,
        default=None,
        help="keep only the last N tokens of longer prompts (to fit a short context)",
    )
    parser.add_argument("--max-output-len", type=int, default=None, help="cap output lengths at N tokens")
    parser.add_argument(
        "--static-batching",
        action="store_true",
        help="fixed batches of --max-num-seqs requests, no refill (the baseline)",
    )
    parser.add_argument(
        "--output-json", type=Path, default=None, help="write the command, machine, config and results here"
    )
    parser.add_argument("--progress", action="store_true", help="show a progress bar (adds overhead)")
    add_cost_arg(parser)
    parser.set_defaults(func=cmd_throughput)


def cmd_throughput(args: argparse.Namespace) -> None:
    from tokenmill import LLM
    from tokenmill.bench.datasets import check_fits, make_workload
    from tokenmill.bench.throughput import run_throughput
    from tokenmill.engine.engine_args import describe_speculative, engine_kwargs

    llm = LLM(args.model, **engine_kwargs(args))
    requests = make_workload(
        args.workload,
        llm.config.model.vocab_size,
        seed=args.seed,
        num_requests=args.num_prompts,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
        tokenizer=llm.get_tokenizer(),
    )
    check_fits(requests, llm.config.model.max_model_len)
    result = run_throughput(llm, requests, args.static_batching, args.max_num_seqs, use_tqdm=args.progress)
    mode = f"static batches of {args.max_num_seqs}" if args.static_batching else "continuous batching"
    spec = describe_speculative(llm.config.speculative)
    print(f"\n{args.workload}: {mode}, {engine_config(llm)['dtype']}, {llm.config.model.model}, speculative {spec}")
    print(format_result(result))
    cost = (
        None if args.cost_per_hour is None else cost_report(args.cost_per_hour, result.output_tok_s, result.total_tok_s)
    )
    if cost is not None:
        print(format_cost(cost))
    if llm.engine.runner.cuda_graph_capture_s is not None:  # before the timed window, not in it
        print(f"  CUDA graph capture took {llm.engine.runner.cuda_graph_capture_s:.2f} s at startup")
    if args.output_json:
        report = {
            "command": shlex.join(sys.argv),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
            "machine": machine_info(),
            "config": engine_config(llm),
            "workload": {
                "name": args.workload,
                "seed": args.seed,
                "num_requests": len(requests),
                "max_prompt_len": args.max_prompt_len,
                "max_output_len": args.max_output_len,
            },
            "results": result.to_dict() | (cost or {}),
        }
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output_json}")


def format_result(result: ThroughputResult) -> str:
    util = result.kv_slot_utilization
    rows = [
        ("requests", f"{result.num_requests}"),
        ("prompt / output tokens", f"{result.prompt_tokens} / {result.output_tokens}"),
        ("elapsed", f"{result.elapsed_s:.2f} s"),
        ("requests/s", f"{result.requests_per_s:.2f}"),
        ("output tok/s", f"{result.output_tok_s:.1f}"),
        ("total tok/s", f"{result.total_tok_s:.1f}"),
        ("decode tok/s (decode-only steps)", f"{result.decode_tok_s:.1f}"),
        ("KV-slot utilisation", f"{util:.1%} (waste {1 - util:.1%})"),
        ("prefix cache hit rate", f"{result.prefix_cache_hit_rate:.1%}"),
        ("preemptions", f"{result.num_preemptions}"),
        ("engine steps", f"{result.num_steps}"),
    ]
    if result.speculative:
        rows += [
            ("draft / accepted tokens", f"{result.spec_num_draft_tokens} / {result.spec_num_accepted_tokens}"),
            ("acceptance rate", f"{result.acceptance_rate:.1%}"),
            ("mean accepted length", f"{result.mean_accepted_length:.2f} tokens per verifying step"),
        ]
    rows.append(("outputs sha256", result.outputs_sha256[:16]))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def engine_config(llm: LLM) -> dict[str, Any]:
    """The resolved engine settings that change throughput."""
    config = llm.config
    return {
        "model": config.model.model,
        "load_format": config.model.load_format,
        "dtype": config.model.dtype,
        "max_model_len": config.model.max_model_len,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "scheduling_policy": config.scheduler.policy,
        "async_scheduling": config.scheduler.async_scheduling,
        "block_size": config.cache.block_size,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "num_kv_blocks": llm.engine.num_blocks,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "device": config.device,
        "attention_backend": llm.engine.runner.backend.name,
        "seed": config.model.seed,
        "quantization": config.model.quantization,
        "weight_dtype": config.model.weight_dtype or config.model.dtype,
        "enforce_eager": config.enforce_eager,
        "speculative_config": None if config.speculative is None else dataclasses.asdict(config.speculative),
        "cuda_graph_capture_s": llm.engine.runner.cuda_graph_capture_s,  # None: no graphs (CPU, eager)
    }
