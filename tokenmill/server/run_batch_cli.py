"""The flags of `tokenmill run-batch` (run_batch.py); light to import, as every command's parser is built
on each start."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from tokenmill.config import EngineArgs
from tokenmill.engine.engine_args import add_engine_args, engine_kwargs


def add_run_batch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run-batch",
        help="run a Batch API file (JSONL of chat, completions or embeddings requests) offline",
        description="Run every line of an OpenAI Batch API input file and write one output line per request "
        "(OpenAI's format; failed requests carry their error). Default model: the embedded one.",
    )
    parser.add_argument("-i", "--input", required=True, metavar="FILE", help="the batch file (JSONL)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="where the output lines go")
    parser.add_argument(
        "--max-in-flight", type=int, default=None, metavar="N", help="requests at once (default: --max-num-seqs)"
    )
    add_engine_args(parser)
    parser.set_defaults(func=cmd_run_batch)
    return parser


def cmd_run_batch(args: argparse.Namespace) -> None:
    from tokenmill.server.batch_lines import parse_batch_lines
    from tokenmill.server.run_batch import run_batch

    try:
        data = Path(args.input).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the batch file: {exc}") from exc
    lines = parse_batch_lines(data)
    engine_args = EngineArgs(model=args.model, **engine_kwargs(args))
    counts = asyncio.run(run_batch(engine_args, lines, Path(args.output), args.max_in_flight))
    print(f"{counts.completed} of {counts.total} requests succeeded, {counts.failed} failed: {args.output}")
