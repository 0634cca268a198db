"""`tokenmill bench compare` and `tokenmill bench setup-peer`: the command-line side of compare.py and peers/.

    tokenmill bench setup-peer ct2
    tokenmill bench compare --workload random-cpu --peers vllm,llamacpp,ct2,hf --repeat 3 \\
        --output-json compare.json --plot compare.png
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from tokenmill.bench.datasets import TOKEN_WORKLOADS
from tokenmill.bench.peers import PEERS


def _default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_setup_peer_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "setup-peer",
        help="build a peer engine's own virtualenv under $TOKENMILL_CACHE/peers/NAME",
        description="Build a peer engine's virtualenv (idempotent: finished steps are skipped). "
        + "; ".join(f"{s.name}: {s.description}" for s in PEERS.values()),
    )
    parser.add_argument("name", choices=list(PEERS))
    parser.add_argument("--force", action="store_true", help="delete the virtualenv and build it again")
    parser.set_defaults(func=cmd_setup_peer)


def cmd_setup_peer(args: argparse.Namespace) -> None:
    from tokenmill.bench.peers import setup_peer

    try:
        record = setup_peer(PEERS[args.name], force=args.force)
    except RuntimeError as exc:
        sys.exit(f"setup of {args.name} failed: {exc}")
    print(
        f"{args.name} {record['version']} is set up: {record['size_bytes'] / 2**30:.2f} GiB, "
        f"{record['seconds']} s, python {record['python']}"
    )


def add_compare_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="the same requests through tokenmill and peer engines, side by side, with the roofline",
        description="Runs tokenmill and each set-up peer (in subprocesses) on the same workload and weights, "
        "reports median output/total tok/s of --repeat runs, the ratio to tokenmill and the fraction "
        "of this machine's roofline. Peers not set up are skipped with a note.",
    )
    parser.add_argument("--workload", default="random-cpu", choices=TOKEN_WORKLOADS)
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {','.join(PEERS)}")
    parser.add_argument("--model", default=None, help="HF folder or preset name (default: embedded SmolLM2-135M)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto | float32 | bfloat16 | int8 (q8_0 / int8 peers) | q4_0 | q4_1 (tokenmill int4, llama.cpp's formats)",
    )
    parser.add_argument(
        "--peer-dtype",
        default="same",
        choices=["same", "best"],
        help="same: peers run --dtype; best: each peer runs every float dtype it has (float32, bfloat16) and "
        "its fastest is reported (each engine at the setting its users would choose on this CPU)",
    )
    parser.add_argument(
        "--cpu-isa",
        default="native",
        choices=["native", "avx2"],
        help="avx2: every engine (and the roofline) runs as on an AVX2-only CPU, each through its own libraries' "
        "switches (torch, MKL, oneDNN, vLLM's AVX2 kernels, an AVX2 build of ggml): for a CPU with AVX-512",
    )
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-prompt-len", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per engine; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=_default_threads())
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="concurrent sequences for tokenmill, vllm and llamacpp (default: each one's own)",
    )
    parser.add_argument("--hf-batch-sizes", type=_int_list, default=None, help="static batch sizes to try")
    parser.add_argument("--ct2-batch-sizes", type=_int_list, default=None, help="static batch sizes to try")
    parser.add_argument("--no-tokenmill", dest="include_tokenmill", action="store_false")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine")
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG bar chart (needs tokenmill[plot])")
    parser.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> None:
    if args.cpu_isa == "avx2":  # before torch picks its kernels in this process (the roofline runs here)
        from tokenmill.bench.peers.isa import AVX2_ENV

        os.environ.update(AVX2_ENV)
    from tokenmill.bench.compare import CompareOptions, format_table, plot, run_compare
    from tokenmill.bench.report import machine_info

    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    engine_options = {}
    if args.hf_batch_sizes:
        engine_options["hf"] = {"batch_sizes": args.hf_batch_sizes}
    if args.ct2_batch_sizes:
        engine_options["ct2"] = {"batch_sizes": args.ct2_batch_sizes}
    opts = CompareOptions(
        workload=args.workload,
        peers=peers,
        model=args.model,
        dtype=args.dtype,
        peer_dtype=args.peer_dtype,
        num_prompts=args.num_prompts,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
        repeat=args.repeat,
        seed=args.seed,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        timeout_s=args.timeout,
        include_tokenmill=args.include_tokenmill,
        engine_options=engine_options,
        cpu_isa=args.cpu_isa,
    )
    report = run_compare(opts)
    print(
        f"\n{args.workload}, {report.num_requests} requests, {Path(report.model_folder).name}, {report.dtype}, "
        f"{opts.threads} threads, median of {opts.repeat}\n"
    )
    print(format_table(report))
    if args.plot:
        print(plot(report, args.plot))
    if args.output_json:
        data = {"command": shlex.join(sys.argv), "machine": machine_info(), **report.to_dict()}
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.output_json}")
