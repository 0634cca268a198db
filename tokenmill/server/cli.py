"""`tokenmill serve [MODEL]`: the OpenAI-compatible server on the command line."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from typing import TYPE_CHECKING

from tokenmill.server.config import API_KEY_ENV, LOG_FORMATS, PREFIX_CACHE_ISOLATION, ServerConfig
from tokenmill.server.models.config import PoolConfig, parse_extra_model
from tokenmill.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tokenmill.engine.engine_args import add_engine_args

    d = ServerConfig()
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
    add_engine_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=d.host, help="address to bind (default 127.0.0.1: this machine only)")
    server.add_argument("--port", type=int, default=d.port)
    server.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve https with this certificate (PEM)")
    server.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    server.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="CA bundle for client certificates")
    server.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=d.ssl_cert_reqs,
        choices=[0, 1, 2],
        help="client certificates: 0 not asked (default), 1 optional, 2 required (with --ssl-ca-certs)",
    )
    server.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="HOSTS",
        help="Host names to answer (repeat, or comma-separate; '*.example.com', '*' for any); "
        "default: on loopback only localhost, 127.0.0.1 and [::1] (against DNS rebinding), else any",
    )
    server.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGINS",
        help="browser origins allowed by CORS, e.g. https://app.example.com (repeat, or comma-separate); "
        "default: no CORS",
    )
    server.add_argument("--served-model-name", default=None, help="the model id clients send (default: folder name)")
    server.add_argument(
        "--api-key",
        action="append",
        default=[],
        dest="api_keys",
        help=f"require this key (repeat for several; also ${API_KEY_ENV}, comma-separated)",
    )
    server.add_argument("--requests-per-min", type=int, default=None, help="per-key request limit")
    server.add_argument(
        "--tokens-per-min",
        type=int,
        default=None,
        help="per-key token limit (prompt + max_tokens, unused output refunded)",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        help="beyond this many waiting requests, answer 429 at once",
    )
    server.add_argument("--max-waiting-tokens", type=int, default=d.max_waiting_tokens)
    server.add_argument("--max-n", type=int, default=d.max_n)
    server.add_argument(
        "--max-logit-bias",
        type=int,
        default=d.max_logit_bias,
        metavar="N",
        help=f"most logit_bias entries one request may give; more get 400 (default {d.max_logit_bias}, as OpenAI)",
    )
    server.add_argument(
        "--max-prompt-logprobs-entries",
        type=int,
        default=d.max_prompt_logprobs_entries,
        metavar="N",
        help="most prompt logprobs one request may ask for with echo: (logprobs + 1) x prompt tokens, summed over "
        f"its prompts (n does not multiply it); more get 400 (default {d.max_prompt_logprobs_entries})",
    )
    server.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="beyond N open connections/tasks, answer 503 at once (uvicorn's limit_concurrency; default: none)",
    )
    server.add_argument(
        "--body-read-timeout",
        type=float,
        default=d.body_read_timeout_s,
        metavar="SECONDS",
        help="a request's body must arrive within this many seconds of its headers, else 408 "
        f"(against slow clients; default {d.body_read_timeout_s:g})",
    )
    server.add_argument(
        "--header-read-timeout",
        type=float,
        default=d.header_read_timeout_s,
        metavar="SECONDS",
        help="a request's headers must arrive within this many seconds of the connection opening (or of its "
        "first byte on a kept-alive connection), else 408 and close (against slow-loris clients; "
        f"default {d.header_read_timeout_s:g})",
    )
    server.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted")
    server.add_argument("--max-prompt-tokens", type=int, default=None)
    server.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout_s,
        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted",
    )
    server.add_argument(
        "--memory-pressure-threshold",
        type=float,
        default=d.memory_pressure_threshold,
        help="answer new requests 503 (Retry-After) while the KV cache is at least this full AND the waiting "
        "queue holds at least this share of the cache's capacity in prompt tokens; 0 or less: never",
    )
    server.add_argument(
        "--max-engine-restarts",
        type=int,
        default=d.max_engine_restarts,
        help="when the engine dies (its process killed, or model steps failing in a row), start a new one, at "
        "most this many times per 10 minutes; requests with no output yet run again on it. 0: stay dead",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take from arrival to its last token; past it, it is aborted with a 504 "
        "(streams: an error event). Requests may ask for less (request_timeout), never more. Default: none",
    )
    server.add_argument(
        "--max-queue-time",
        type=float,
        default=None,
        help="seconds a request may wait for its first output (its first scheduled step's result); past it, "
        "it is aborted with a 504. Requests may ask for less (max_queue_time), never more. Default: none",
    )
    server.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=d.engine_stall_timeout_s,
        help="requests in flight and no step finished for this long makes /health fail",
    )
    server.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="run the engine core on a thread of the server process instead of its own process "
        "(debugging; it then shares the GIL with HTTP and detokenization, so it is slower)",
    )
    server.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without a key even when API keys are set (by default it then needs one)",
    )
    server.add_argument(
        "--priority-keys",
        action="append",
        default=[],
        metavar="KEYS",
        help="API keys whose requests' `priority` is honoured (repeat, or comma-separate); "
        "other requests count as priority 0",
    )
    server.add_argument(
        "--max-failed-logins",
        type=int,
        default=d.max_failed_logins,
        help="failed logins (401s) per minute from one address before it is answered 429 for the rest of the minute",
    )
    server.add_argument(
        "--audit-log",
        default=None,
        metavar="FILE",
        help="append one JSON line per finished completion/chat request (time, key hash, client, route, "
        "model, status, tokens, latency, finish reason) to FILE",
    )
    server.add_argument(
        "--audit-log-content",
        action="store_true",
        help="also write each request's prompt and output to the audit log (off by default: they may be sensitive)",
    )
    server.add_argument(
        "--prefix-cache-isolation",
        choices=PREFIX_CACHE_ISOLATION,
        default=d.prefix_cache_isolation,
        help="shared: one prefix cache for every API key (a request's cache_salt still keeps it apart); "
        "per-key: salt every request with its API key, so that no key can hit, or time, another key's cached "
        "prompts (default: shared)",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help='how to find tool calls in the text of tool_choice "auto" (the default when a request gives tools): '
        "the format the model's chat template teaches it; hermes: <tool_call>{json}</tool_call> (Qwen2.5, Qwen3, "
        'Hermes), llama3_json: {"name": ..., "parameters": ...} (Llama 3.1-3.3). Without it, "auto" gets 400; '
        '"required" and named functions work without it',
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _add_pool_args(parser)
    _add_operations_args(parser)
    parser.set_defaults(func=cmd_serve)
    return parser


def _add_pool_args(parser: argparse.ArgumentParser) -> None:
    pool = parser.add_argument_group("several models (requests pick one by their `model` field)")
    pool.add_argument(
        "--registry",
        default=None,
        metavar="DIR",
        help="also serve every version and alias of this model registry (tokenmill models add), loaded on "
        "first use: name@version, an alias, or a bare name (its alias, else its highest version)",
    )
    pool.add_argument(
        "--extra-model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also serve the model at PATH as NAME, loaded on first use (repeat for several)",
    )
    pool.add_argument("--keep-alive", type=float, default=None, metavar="SECONDS", help="unload a model idle this long")
    pool.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        metavar="N",
        help="at most N resident models, the default one included; the least recently used idle one makes room",
    )
    pool.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        metavar="GB",
        help="resident models' estimated weights + KV cache stay within this; a load that cannot fit gets 503",
    )
    pool.add_argument(
        "--admin-key", default=None, metavar="KEY", help="the key of /admin/... (load, unload, move aliases)"
    )
    pool.add_argument(
        "--access-config",
        default=None,
        metavar="FILE",
        help="API key -> models it may use (default: the registry's access.json, if present)",
    )


def _add_operations_args(parser: argparse.ArgumentParser) -> None:
    ops = parser.add_argument_group("operations (/dashboard, Prometheus alerts, logs and traces)")
    ops.add_argument("--slo-ttft-ms", type=float, default=None, help="time-to-first-token SLO (p99), drawn as a line")
    ops.add_argument("--slo-itl-ms", type=float, default=None, help="inter-token latency SLO (p99), drawn as a line")
    ops.add_argument(
        "--throughput-baseline",
        type=float,
        default=None,
        metavar="TOKS",
        help="total tokens/s this server should reach under load (the throughput alerts' baseline); "
        "default: the dashboard's best recent minute and the alerts' recording rule",
    )
    ops.add_argument(
        "--cost-per-hour",
        type=float,
        default=None,
        metavar="DOLLARS",
        help="$ per hour of this server: cost per 1M tokens",
    )
    ops.add_argument("--no-dashboard", action="store_true", help="do not serve /dashboard")
    ops.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="json: one JSON object per log line")
    ops.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export per-request spans (queued, prefill, decode) over OTLP/HTTP, e.g. "
        "http://localhost:4318/v1/traces (needs pip install 'tokenmill[otel]')",
    )


def _pool_config(args: argparse.Namespace) -> PoolConfig:
    return PoolConfig(
        registry=args.registry,
        extra_models=tuple(parse_extra_model(v) for v in args.extra_model),
        keep_alive_s=args.keep_alive,
        max_loaded_models=args.max_loaded_models,
        memory_budget_gb=args.memory_budget_gb,
        admin_key=args.admin_key,
        access_file=args.access_config,
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    from tokenmill.server.hosts import split_commas

    try:
        return _server_config(args, split_commas(args.allowed_hosts), split_commas(args.allowed_origins))
    except ValueError as exc:
        raise SystemExit(f"tokenmill serve: error: {exc}") from None


def _server_config(args: argparse.Namespace, hosts: tuple[str, ...], origins: tuple[str, ...]) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        allowed_hosts=hosts,
        allowed_origins=origins,
        served_model_name=args.served_model_name,
        api_keys=tuple(args.api_keys),
        requests_per_min=args.requests_per_min,
        tokens_per_min=args.tokens_per_min,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
        max_n=args.max_n,
        max_logit_bias=args.max_logit_bias,
        max_prompt_logprobs_entries=args.max_prompt_logprobs_entries,
        limit_concurrency=args.limit_concurrency,
        body_read_timeout_s=args.body_read_timeout,
        header_read_timeout_s=args.header_read_timeout,
        max_tokens=args.max_tokens_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        engine_stall_timeout_s=args.engine_stall_timeout,
        request_timeout_s=args.request_timeout,
        max_queue_time_s=args.max_queue_time,
        metrics_public=args.metrics_public,
        priority_keys=tuple(k for arg in args.priority_keys for k in arg.split(",") if k.strip()),
        max_failed_logins=args.max_failed_logins,
        prefix_cache_isolation=args.prefix_cache_isolation,
        engine_in_thread=args.engine_in_thread,
        max_engine_restarts=args.max_engine_restarts,
        memory_pressure_threshold=args.memory_pressure_threshold if args.memory_pressure_threshold > 0 else None,
        audit_log=args.audit_log,
        audit_log_content=args.audit_log_content,
        tool_call_parser=args.tool_call_parser,
        models=_pool_config(args),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
        throughput_baseline=args.throughput_baseline,
        cost_per_hour=args.cost_per_hour,
        dashboard=not args.no_dashboard,
        log_format=args.log_format,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def engine_and_server_config(args: argparse.Namespace) -> tuple[EngineArgs, ServerConfig]:
    """The engine's and the server's settings of parsed `tokenmill serve` flags."""
    from tokenmill.config import EngineArgs
    from tokenmill.engine.engine_args import engine_kwargs

    return EngineArgs(model=args.model_path or args.model, **engine_kwargs(args)), server_config(args)


def cmd_serve(args: argparse.Namespace) -> None:
    from tokenmill.server.launcher import serve

    logging.getLogger("tokenmill").setLevel(args.log_level.upper())  # uvicorn configures its own loggers
    if args.log_format == "json":
        from tokenmill.metrics.logs import use_json_logs

        use_json_logs(args.log_level)
    if args.otlp_traces_endpoint and importlib.util.find_spec("opentelemetry.exporter.otlp") is None:
        raise SystemExit("tokenmill serve: error: --otlp-traces-endpoint needs pip install 'tokenmill[otel]'")
    serve(*engine_and_server_config(args), args.log_level)
