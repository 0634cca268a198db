"""The server's own settings (the engine's are `EngineArgs`), and the state its routes share."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.chat_template import check_template_kwargs
from tokenmill.lora_request import LoRARequest
from tokenmill.metrics.prometheus import ServerMetrics
from tokenmill.server.errors import APIError
from tokenmill.server.lora_modules import LoRAModules, parse_lora_module
from tokenmill.server.reasoning import REASONING_PARSERS, ReasoningParser
from tokenmill.server.security import ApiKeys, LoginThrottle, RateLimiter
from tokenmill.server.tool_parsers import TOOL_PARSERS, ToolParser
from tokenmill.settings import setting
from tokenmill.structured.limits import (
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_GRAMMAR_CHOICES,
    MAX_GRAMMAR_BYTES_CEILING,
    GrammarLimits,
)

if TYPE_CHECKING:
    from tokenmill.server.pool.pool import ModelPool

API_KEY_ENV = "TOKENMILL_API_KEY"  # one key, or several separated by commas
ADMIN_KEY_ENV = "TOKENMILL_ADMIN_KEY"  # the admin API's key (--admin-key-file, --admin-key)
PREFIX_CACHE_ISOLATION = ("shared", "per-key")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


ACCESS_FILE = "access.json"  # in the registry's folder: API key -> the models it may use


def parse_template_kwargs(value: str | dict[str, Any]) -> dict[str, Any]:
    """`--chat-template-kwargs`: a JSON object (from the command line) or a mapping (from YAML)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--chat-template-kwargs takes a JSON object: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("--chat-template-kwargs takes a JSON object")
    return check_template_kwargs(value)


def parse_extra_model(value: str) -> tuple[str, str]:
    """`NAME=PATH` from the command line."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--extra-model takes NAME=PATH, got {value!r}")
    return name.strip(), path.strip()


@dataclass(frozen=True)
class PoolConfig:
    """Serving several models beside the default one (`tokenmill serve --registry DIR`, `--extra-model`)."""

    registry: str | None = setting(
        None,
        group="models",
        metavar="DIR",
        help="also serve every version and alias of this model registry (tokenmill models add), loaded on "
        "first use: name@version, an alias, or a bare name (its alias, else its highest version)",
    )
    extra_models: tuple[tuple[str, str], ...] = setting(
        (),
        group="models",
        aliases=("--extra-model",),
        metavar="NAME=PATH",
        parse=parse_extra_model,
        help="also serve the model at PATH as NAME, loaded on first use (repeat for several)",
    )
    keep_alive_s: float | None = setting(
        None, group="models", aliases=("--keep-alive",), metavar="SECONDS", help="unload a model idle this long"
    )
    max_loaded_models: int | None = setting(
        4,
        group="models",
        metavar="N",
        help="at most N resident models, the default one included; the least recently used idle one makes room "
        "(default 4)",
    )
    memory_budget_gb: float | None = setting(
        None,
        group="models",
        metavar="GB",
        help="resident models' estimated weights + KV cache stay within this; a load that cannot fit gets 503",
    )
    admin_key: str | None = setting(
        None,
        group="models",
        metavar="KEY",
        help=f"the key of /admin/... (load, unload, move aliases); visible in `ps`: prefer ${ADMIN_KEY_ENV} "
        "or --admin-key-file",
    )
    access_file: str | None = setting(
        None,
        group="models",
        aliases=("--access-config",),
        metavar="FILE",
        help="API key -> models it may use (default: the registry's access.json, if present)",
    )
    max_loading_models: int = setting(
        2,
        group="models",
        metavar="N",
        help="at most N models loading at once (each load starts an engine and reads all its files); a request "
        "that would start another gets 503 with Retry-After (default 2)",
    )
    model_loads_per_hour: int = setting(
        20,
        group="models",
        metavar="N",
        help="model loads each API key may start per hour by asking for a model that is not loaded (the admin "
        "API's loads are not counted); past it 429 with Retry-After (default 20; 0: no limit)",
    )
    admin_key_file: str | None = setting(
        None,
        group="models",
        metavar="FILE",
        help=f"read the admin key from the first line of FILE (else --admin-key, else ${ADMIN_KEY_ENV})",
    )

    def __post_init__(self) -> None:
        if self.keep_alive_s is not None and not self.keep_alive_s > 0:
            raise ValueError("--keep-alive must be a positive number of seconds")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError("--max-loaded-models must be at least 1 (the default model counts as one)")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError("--memory-budget-gb must be a positive number")
        if self.admin_key is not None and not self.admin_key.strip():
            raise ValueError("--admin-key must not be empty")
        names = [name for name, _ in self.extra_models]
        if len(set(names)) != len(names):
            raise ValueError("--extra-model names must differ from each other")
        if self.max_loading_models < 1:
            raise ValueError("--max-loading-models must be at least 1")
        if self.model_loads_per_hour < 0:
            raise ValueError("--model-loads-per-hour must be 0 (no limit) or more")
        if self.admin_key is not None and self.admin_key_file is not None:
            raise ValueError("give the admin key once: --admin-key or --admin-key-file, not both")

    def resolved_admin_key(self) -> str | None:
        """The admin API's key: --admin-key, else --admin-key-file's first line, else $TOKENMILL_ADMIN_KEY;
        None (the admin API is off) without any."""
        if self.admin_key is not None:
            return self.admin_key
        if self.admin_key_file is not None:
            path = Path(self.admin_key_file).expanduser()
            try:
                key = (path.read_text().splitlines() or [""])[0].strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"--admin-key-file {path}: cannot read it ({exc})") from None
            if not key:
                raise ValueError(f"--admin-key-file {path}: its first line is empty")
            return key
        return os.environ.get(ADMIN_KEY_ENV, "").strip() or None

    @property
    def enabled(self) -> bool:
        """Whether the server routes requests by their `model` field to several engines."""
        return self.registry is not None or bool(self.extra_models)

    def access_path(self) -> Path | None:
        """The access config in force: --access-config, else the registry's access.json if it exists."""
        if self.access_file is not None:
            return Path(self.access_file).expanduser()
        if self.registry is not None:
            path = Path(self.registry).expanduser() / ACCESS_FILE
            return path if path.is_file() else None
        return None


def _threshold(value: str | float) -> float | None:
    """--memory-pressure-threshold: 0 or less turns the check off."""
    number = float(value)
    return number if number > 0 else None


@dataclass(frozen=True)
class ServerConfig:
    """The server's own settings (the engine's are `EngineArgs`), each field also a `tokenmill serve` flag."""

    host: str = setting("127.0.0.1", group="network", help="address to bind (default 127.0.0.1: this machine only)")
    port: int = setting(8000, group="network", help="port to listen on")
    ssl_certfile: str | None = setting(
        None, group="network", metavar="FILE", help="serve https with this certificate (PEM)"
    )
    ssl_keyfile: str | None = setting(None, group="network", metavar="FILE", help="the certificate's private key (PEM)")
    ssl_ca_certs: str | None = setting(None, group="network", metavar="FILE", help="CA bundle for client certificates")
    ssl_cert_reqs: int = setting(
        0,
        group="network",
        choices=(0, 1, 2),
        help="client certificates: 0 not asked (default), 1 optional, 2 required (with --ssl-ca-certs)",
    )
    allowed_hosts: tuple[str, ...] = setting(
        (),
        group="network",
        metavar="HOSTS",
        help="Host names to answer (repeat, or comma-separate; '*.example.com', '*' for any); "
        "default: on loopback only localhost, 127.0.0.1 and [::1] (against DNS rebinding), else any",
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        group="network",
        metavar="ORIGINS",
        help="browser origins allowed by CORS, e.g. https://app.example.com (repeat, or comma-separate); "
        "default: no CORS",
    )
    limit_concurrency: int | None = setting(
        None,
        group="network",
        metavar="N",
        help="beyond N open connections/tasks, answer 503 at once (uvicorn's limit_concurrency; default: none)",
    )
    served_model_name: str | None = setting(
        None, group="model", help="the model id clients send (default: folder name)"
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        group="lora",
        metavar="NAME=PATH",
        help="LoRA adapters to serve from the start, each as the model id NAME (repeat, or comma-separate; "
        "needs --enable-lora); PATH: the adapter's folder, or its id in the model registry (--registry, "
        "else the default one); more load at runtime through POST /v1/load_lora_adapter",
    )
    api_keys: tuple[str, ...] = setting(
        (),
        group="auth",
        aliases=("--api-key",),
        help=f"require this key (repeat for several; also ${API_KEY_ENV}, comma-separated)",
    )
    priority_keys: tuple[str, ...] = setting(
        (),
        group="auth",
        metavar="KEYS",
        help="API keys whose requests' `priority` is honoured (repeat, or comma-separate); "
        "other requests count as priority 0",
    )
    metrics_public: bool = setting(
        False,
        group="auth",
        help="serve /metrics without a key even when API keys are set (by default it then needs one)",
    )
    max_failed_logins: int = setting(
        10,
        group="auth",
        help="failed logins (401s) per minute from one address before it is answered 429 for the rest of the minute",
    )
    prefix_cache_isolation: str = setting(
        "shared",
        group="auth",
        choices=PREFIX_CACHE_ISOLATION,
        help="shared: one prefix cache for every API key (a request's cache_salt still keeps it apart); "
        "per-key: salt every request with its API key, so that no key can hit, or time, another key's cached "
        "prompts (default: shared)",
    )
    requests_per_min: int | None = setting(None, group="limits", help="per-key request limit")
    tokens_per_min: int | None = setting(
        None, group="limits", help="per-key token limit (prompt + max_tokens, unused output refunded)"
    )
    max_waiting_requests: int = setting(
        256, group="limits", help="beyond this many waiting requests, answer 429 at once"
    )
    max_waiting_tokens: int = setting(1 << 20, group="limits", help="beyond this many waiting prompt tokens, 429")
    max_n: int = setting(16, group="limits", help="largest n (choices per request)")
    max_logit_bias: int = setting(
        300,
        group="limits",
        metavar="N",
        help="most logit_bias entries one request may give; more get 400 (default 300, as OpenAI)",
    )
    # Echo with logprobs: (logprobs + 1) entries per prompt token, summed over the prompts (n shares them).
    # 2^20 lets a full 128k-token context through at OpenAI's top 5 (786,432) and a 48k one at our top 20,
    # while one request cannot make the server build and send an unbounded pile of them.
    max_prompt_logprobs_entries: int = setting(
        1 << 20,
        group="limits",
        metavar="N",
        help="most prompt logprobs one request may ask for with echo: (logprobs + 1) x prompt tokens, summed over "
        "its prompts (n does not multiply it); more get 400 (default 1048576)",
    )
    max_tokens: int | None = setting(
        None, group="limits", aliases=("--max-tokens-limit",), help="largest max_tokens accepted (default: the context)"
    )
    max_prompt_tokens: int | None = setting(
        None, group="limits", help="longest prompt accepted (default: the context - 1)"
    )
    max_prompts_per_request: int = setting(64, group="limits", help="most prompts in one completions request")
    max_body_bytes: int = setting(4 << 20, group="limits", help="largest request body")
    # New requests get 503 while both the KV cache's usage and the queued prompt tokens (as a share of the
    # cache's capacity) are at least this; None: they always queue (up to --max-waiting-*)
    memory_pressure_threshold: float | None = setting(
        0.95,
        group="limits",
        parse=_threshold,
        help="answer new requests 503 (Retry-After) while the KV cache is at least this full AND the waiting "
        "queue holds at least this share of the cache's capacity in prompt tokens; 0 or less: never",
    )
    shutdown_timeout_s: float = setting(
        30.0,
        group="timeouts",
        aliases=("--shutdown-timeout",),
        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted",
    )
    engine_stall_timeout_s: float = setting(
        300.0,
        group="timeouts",
        aliases=("--engine-stall-timeout",),
        help="requests in flight and no step finished for this long makes /health fail",
    )
    request_timeout_s: float | None = setting(
        None,
        group="timeouts",
        aliases=("--request-timeout",),
        help="seconds a request may take from arrival to its last token; past it, it is aborted with a 504 "
        "(streams: an error event). Requests may ask for less (request_timeout), never more. Default: none",
    )
    max_queue_time_s: float | None = setting(
        None,
        group="timeouts",
        aliases=("--max-queue-time",),
        help="seconds a request may wait for its first output (its first scheduled step's result); past it, "
        "it is aborted with a 504. Requests may ask for less (max_queue_time), never more. Default: none",
    )
    body_read_timeout_s: float | None = setting(
        30.0,
        group="timeouts",
        aliases=("--body-read-timeout",),
        metavar="SECONDS",
        help="a request's body must arrive within this many seconds of its headers, else 408 "
        "(against slow clients; default 30)",
    )
    # 20 s, Apache mod_reqtimeout's first deadline: headers are a few hundred bytes sent in one round trip,
    # so even a slow link needs a fraction of it, and a slow-loris client must reconnect every 20 s.
    header_read_timeout_s: float = setting(
        20.0,
        group="timeouts",
        aliases=("--header-read-timeout",),
        metavar="SECONDS",
        help="a request's headers must arrive within this many seconds of the connection opening (or of its "
        "first byte on a kept-alive connection), else 408 and close (against slow-loris clients; default 20)",
    )
    engine_in_thread: bool = setting(
        False,
        group="model",
        help="run the engine core on a thread of the server process instead of its own process "
        "(debugging; it then shares the GIL with HTTP and detokenization, so it is slower)",
    )
    max_engine_restarts: int = setting(
        5,
        group="model",
        help="when the engine dies (its process killed, or model steps failing in a row), start a new one, at "
        "most this many times per 10 minutes; requests with no output yet run again on it. 0: stay dead",
    )
    tool_call_parser: str | None = setting(
        None,
        group="tools",
        choices=sorted(TOOL_PARSERS),
        help='how to find tool calls in the text of tool_choice "auto" (the default when a request gives tools): '
        "the format the model's chat template teaches it; hermes: <tool_call>{json}</tool_call> (Qwen2.5, Qwen3, "
        'Hermes), llama3_json: {"name": ..., "parameters": ...} (Llama 3.1-3.3). Without it, "auto" gets 400; '
        '"required" and named functions work without it',
    )
    audit_log: str | None = setting(
        None,
        group="observability",
        metavar="FILE",
        help="append one JSON line per finished completion/chat request (time, key hash, client, route, "
        "model, status, tokens, latency, finish reason) to FILE",
    )
    audit_log_content: bool = setting(
        False,
        group="observability",
        help="also write each request's prompt and output to the audit log (off by default: they may be sensitive)",
    )
    slo_ttft_ms: float | None = setting(
        None, group="observability", help="time-to-first-token SLO (p99), drawn as a line"
    )
    slo_itl_ms: float | None = setting(
        None, group="observability", help="inter-token latency SLO (p99), drawn as a line"
    )
    throughput_baseline: float | None = setting(
        None,
        group="observability",
        metavar="TOKS",
        help="total tokens/s this server should reach under load (the throughput alerts' baseline); "
        "default: the dashboard's best recent minute and the alerts' recording rule",
    )
    cost_per_hour: float | None = setting(
        None, group="observability", metavar="DOLLARS", help="$ per hour of this server: cost per 1M tokens"
    )
    dashboard: bool = setting(True, group="observability", help="serve /dashboard and /dashboard/data")
    log_format: str = setting(
        "text", group="observability", choices=LOG_FORMATS, help="json: one JSON object per log line"
    )
    log_level: str = setting("info", group="observability", choices=LOG_LEVELS, help="least severe log lines shown")
    otlp_traces_endpoint: str | None = setting(
        None,
        group="observability",
        metavar="URL",
        help="export per-request spans (queued, prefill, decode) over OTLP/HTTP, e.g. "
        "http://localhost:4318/v1/traces (needs pip install 'tokenmill[otel]')",
    )
    # Several models beside the default one (--registry, --extra-model), loaded on demand: PoolConfig's flags
    models: PoolConfig = field(default_factory=PoolConfig)
    # The Responses API (responses.py): stored responses, kept in memory
    response_store_size: int = setting(
        1000,
        group="limits",
        metavar="N",
        help="responses kept for GET /v1/responses/{id} and previous_response_id (store: true); past N the least "
        "recently used is forgotten; 0: none kept",
    )
    response_store_mb: int = setting(
        256,
        group="limits",
        metavar="MB",
        help="the stored responses' text (each counted with its whole conversation) stays within about this many "
        "MB (million characters); past it the least recently used are forgotten",
    )
    # The Batch API (files.py, batches.py, batch_runner.py)
    files_dir: str | None = setting(
        None,
        group="batch",
        metavar="DIR",
        help="where uploaded files, batch outputs and batch state are kept (they survive restarts; unfinished "
        "batches resume); default: $XDG_STATE_HOME/tokenmill/files, else ~/.local/state/tokenmill/files",
    )
    max_file_bytes: int = setting(200 << 20, group="batch", metavar="BYTES", help="largest uploaded file (200 MB)")
    batch_max_in_flight: int = setting(
        4,
        group="batch",
        metavar="N",
        help="batch lines running at once while no online request came in the last 2 s (else one); they are "
        "queued only while no online request runs or waits, in the scheduler's idle class",
    )
    # Reasoning models and chat templates (reasoning.py, chat.py)
    reasoning_parser: str | None = setting(
        None,
        group="tools",
        choices=sorted(REASONING_PARSERS),
        help="put the reply's <think> part in the chat message's reasoning_content (streamed as its own deltas); "
        "qwen3: reasoning where the reply or the prompt opens <think> (not with enable_thinking false); "
        "deepseek_r1: the reply starts in reasoning, up to </think>. Tool calls and constraints apply to the rest",
    )
    chat_template_kwargs: dict[str, Any] | None = setting(
        None,
        group="tools",
        metavar="JSON",
        parse=parse_template_kwargs,
        help="extra variables for the chat template, e.g. '{\"enable_thinking\": false}'; a request's own "
        "chat_template_kwargs take precedence",
    )
    # The engine watchdog (engine/step_watchdog.py)
    engine_step_timeout_s: float | None = setting(
        None,
        group="timeouts",
        aliases=("--engine-step-timeout",),
        metavar="SECONDS",
        help="requests in flight and no engine step finished for this long: the engine is hung, and it is "
        "killed and restarted as after a death (requests with no output yet run again, the others get an "
        "error). Default: max(60, 20 x the 99th percentile of recent step times); 0: never",
    )
    # Behind a reverse proxy (security.py: the failed-login throttle and the audit log see the client)
    forwarded_allow_ips: tuple[str, ...] = setting(
        (),
        group="network",
        metavar="IPS",
        help="proxies (addresses or networks, comma-separated; '*' for any) whose X-Forwarded-For names the "
        "client; from any other peer the header is ignored (default: none, the peer is the client)",
    )

    # Output constraints (constraints.py): what one may ask the grammar library to build, and how long for.
    max_grammar_bytes: int = setting(
        DEFAULT_MAX_GRAMMAR_BYTES,
        group="limits",
        metavar="BYTES",
        help="largest JSON schema, regex, grammar or choice list (as JSON) one request may constrain its output "
        f"with; larger gets 400 (default {DEFAULT_MAX_GRAMMAR_BYTES}, at most {MAX_GRAMMAR_BYTES_CEILING})",
    )
    max_grammar_choices: int = setting(
        DEFAULT_MAX_GRAMMAR_CHOICES,
        group="limits",
        metavar="N",
        help=f"most choices a guided_choice list may hold; more get 400 (default {DEFAULT_MAX_GRAMMAR_CHOICES})",
    )
    grammar_compile_timeout_s: float = setting(
        5.0,
        group="timeouts",
        aliases=("--grammar-compile-timeout",),
        metavar="SECONDS",
        help="an output constraint must compile within this many seconds, else 400 (default 5; within the "
        "size caps a compile takes milliseconds)",
    )

    def __post_init__(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both, or neither")
        if self.prefix_cache_isolation not in PREFIX_CACHE_ISOLATION:
            raise ValueError(f"--prefix-cache-isolation must be one of {', '.join(PREFIX_CACHE_ISOLATION)}")
        for name, value in (
            ("--request-timeout", self.request_timeout_s),
            ("--max-queue-time", self.max_queue_time_s),
            ("--body-read-timeout", self.body_read_timeout_s),
            ("--header-read-timeout", self.header_read_timeout_s),
            ("--grammar-compile-timeout", self.grammar_compile_timeout_s),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError("--limit-concurrency must be at least 1")
        if self.max_logit_bias < 0:
            raise ValueError("--max-logit-bias must not be negative")
        if self.max_prompt_logprobs_entries < 0:
            raise ValueError("--max-prompt-logprobs-entries must not be negative")
        for name, value in (
            ("--slo-ttft-ms", self.slo_ttft_ms),
            ("--slo-itl-ms", self.slo_itl_ms),
            ("--throughput-baseline", self.throughput_baseline),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number")
        if self.cost_per_hour is not None and not self.cost_per_hour >= 0:
            raise ValueError("--cost-per-hour must not be negative")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
        if self.max_file_bytes < 1 or self.batch_max_in_flight < 1:
            raise ValueError("--max-file-bytes and --batch-max-in-flight must be at least 1")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
        parse_template_kwargs(self.chat_template_kwargs or {})
        _ = self.grammar_limits  # caps out of range: ValueError

    @property
    def grammar_limits(self) -> GrammarLimits:
        """--max-grammar-bytes and --max-grammar-choices (a ValueError for values out of range)."""
        return GrammarLimits(self.max_grammar_bytes, self.max_grammar_choices)

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def keys(self) -> list[str]:
        env = os.environ.get(API_KEY_ENV, "")
        return list(self.api_keys) + [k for k in env.split(",") if k.strip()]


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine
    model_name: str
    metrics: ServerMetrics
    keys: ApiKeys
    limiter: RateLimiter
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    draining: bool = False
    models: ModelPool | None = None  # with --registry / --extra-model: the engines by model
    loras: LoRAModules | None = None  # with --enable-lora: the adapters served by name
    routed: bool = False  # the pool picked this state for the request's model: check_model has nothing to do
    # Tokenization and chat templating, off the event loop. One thread: the HF tokenizer keeps per-call
    # settings (split_special_tokens) in shared state, so two encodes at once could let a user's text
    # become control tokens.
    prompt_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-prompts")
    )

    @classmethod
    def create(cls, config: ServerConfig, engine: AsyncEngine) -> ServerState:
        name = config.served_model_name or default_model_name(engine)
        metrics = ServerMetrics(name)
        engine.stats = metrics
        state = cls(
            config,
            engine,
            name,
            metrics,
            ApiKeys(config.keys(), config.priority_keys),
            RateLimiter(config.requests_per_min, config.tokens_per_min),
            LoginThrottle(config.max_failed_logins),
        )
        if engine.config.lora is not None:
            state.loras = LoRAModules(engine, name, config.models.registry)
            for entry in config.lora_modules:
                state.loras.load(*parse_lora_module(entry))
        elif config.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora.")
        return state

    def priority(self, key: str, requested: int) -> int:
        """A request's scheduling priority: what it asked for if its key is one of --priority-keys,
        else 0 (without API keys, every request's is 0), so that no client can jump the queue."""
        return requested if self.keys.honours_priority(key) else 0

    def cache_salt(self, key: str, requested: str | None) -> str | None:
        """A request's prefix-cache salt: its own cache_salt, or with --prefix-cache-isolation per-key a
        hash of its key (and of its own salt, if any), so that no two keys ever share cached blocks."""
        if self.config.prefix_cache_isolation != "per-key":
            return requested
        return "key:" + hashlib.sha256(json.dumps([key, requested]).encode()).hexdigest()

    @property
    def tool_parser(self) -> ToolParser | None:
        name = self.config.tool_call_parser
        return None if name is None else TOOL_PARSERS[name]

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        name = self.config.reasoning_parser
        return None if name is None else REASONING_PARSERS[name]

    @property
    def max_tokens(self) -> int:
        return min(self.config.max_tokens or self.engine.max_model_len, self.engine.max_model_len)

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """What a request gets for the sampling fields it leaves out (from --generation-config)."""
        return self.engine.config.model.sampling_defaults

    @property
    def default_max_tokens(self) -> int | None:
        """max_tokens for a request that gives none: the model's max_new_tokens, if it sets one."""
        value = self.sampling_defaults.get("max_tokens")
        return None if value is None else int(value)

    @property
    def max_prompt_tokens(self) -> int:
        return min(self.config.max_prompt_tokens or self.engine.max_model_len, self.engine.max_model_len - 1)

    def check_model(self, model: str | None, adapters: bool = True) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 model_not_found for a
        name this server does not serve. `adapters`: the endpoint runs adapters (generation does;
        pooling runs the base model only: 400 for an adapter's name)."""
        if model is None or model == self.model_name or self.routed:
            return None
        lora = self.loras.get(model) if self.loras is not None else None
        if lora is None:
            served = [self.model_name, *self.loras.by_name] if self.loras is not None else [self.model_name]
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {', '.join(map(repr, served))}.",
                "model_not_found",
                "model",
            )
        if not adapters:
            raise APIError(400, f"{model!r} is a LoRA adapter: this endpoint runs the base model only.", param="model")
        return lora

    def response_model(self, model: str | None) -> str:
        """The `model` a reply names: the adapter the request named, else the served model."""
        return model if model is not None and self.loras is not None and self.loras.get(model) else self.model_name

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica.", "shutting_down")
        if self.engine.is_dead:
            raise APIError(503, "the engine has stopped (restarts spent); the server must be restarted.", "engine_dead")


def default_model_name(engine: AsyncEngine) -> str:
    from pathlib import Path

    return Path(engine.config.model.model).name or engine.config.model.model
