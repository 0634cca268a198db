"""`tokenmill serve [MODEL]`: the OpenAI-compatible server on the command line."""

from __future__ import annotations

import argparse
import importlib.util
import logging

from tokenmill.config import EngineArgs
from tokenmill.server.config import PoolConfig, ServerConfig
from tokenmill.settings import add_config_flag, add_flags, add_help_group_flag, from_namespace
from tokenmill.startup_phases import StartupPhases


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`tokenmill serve`: one flag per EngineArgs, ServerConfig and PoolConfig field (tokenmill/settings.py),
    in groups (`--help-group GROUP` shows one), and `--config FILE.yaml` with the same keys."""
    parser = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (default: the embedded model on 127.0.0.1:8000)",
        description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /ready, /metrics, /version.",
    )
    parser.add_argument(
        "model_path",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF folder, .gguf file or preset (default: the embedded SmolLM2-135M-Instruct)",
    )
    add_flags(parser, EngineArgs)
    add_flags(parser, ServerConfig)
    add_flags(parser, PoolConfig)
    add_config_flag(parser, [EngineArgs, ServerConfig, PoolConfig])
    add_help_group_flag(parser)
    parser.set_defaults(func=cmd_serve)
    return parser


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's settings of parsed `tokenmill serve` flags; a bad value ends the command with its message."""
    try:
        return from_namespace(ServerConfig, args, models=from_namespace(PoolConfig, args))
    except ValueError as exc:
        raise SystemExit(f"tokenmill serve: error: {exc}") from None


def engine_and_server_config(args: argparse.Namespace) -> tuple[EngineArgs, ServerConfig]:
    """The engine's and the server's settings of parsed `tokenmill serve` flags."""
    from tokenmill.engine.engine_args import engine_kwargs

    return EngineArgs(model=args.model_path or args.model, **engine_kwargs(args)), server_config(args)


def cmd_serve(args: argparse.Namespace) -> None:
    logging.getLogger("tokenmill").setLevel(args.log_level.upper())  # uvicorn configures its own loggers
    if args.log_format == "json":
        from tokenmill.metrics.logs import use_json_logs

        use_json_logs(args.log_level)
    if args.otlp_traces_endpoint and importlib.util.find_spec("opentelemetry.exporter.otlp") is None:
        raise SystemExit("tokenmill serve: error: --otlp-traces-endpoint needs pip install 'tokenmill[otel]'")
    phases = StartupPhases()
    phases.since_process_start("python and the CLI")
    with phases.phase("server imports"):
        from tokenmill.server.launcher import serve
    serve(*engine_and_server_config(args), args.log_level, phases)
