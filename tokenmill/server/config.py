"""The server's own settings (the engine's are `EngineArgs`), and the state its routes share."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics.prometheus import ServerMetrics
from tokenmill.server.errors import APIError
from tokenmill.server.models.config import PoolConfig
from tokenmill.server.security import ApiKeys, LoginThrottle, RateLimiter
from tokenmill.server.tool_parsers import TOOL_PARSERS, ToolParser

if TYPE_CHECKING:
    from tokenmill.server.models.pool import ModelPool

API_KEY_ENV = "TOKENMILL_API_KEY"  # one key, or several separated by commas
PREFIX_CACHE_ISOLATION = ("shared", "per-key")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    ssl_certfile: str | None = None  # with ssl_keyfile: serve https
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # CA bundle to check client certificates against
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE (0), CERT_OPTIONAL (1) or CERT_REQUIRED (2): client certificates
    allowed_hosts: tuple[str, ...] = ()  # Host names to answer; (): loopback names on loopback, else any
    allowed_origins: tuple[str, ...] = ()  # CORS origins; (): no CORS headers
    served_model_name: str | None = None  # default: the model folder's name
    api_keys: tuple[str, ...] = ()  # with API_KEY_ENV's keys added by `keys()`
    requests_per_min: int | None = None  # per key; None: no limit
    tokens_per_min: int | None = None  # per key: prompt + max_tokens, unused output refunded
    max_waiting_requests: int = 256  # beyond this the server answers 429 at once
    max_waiting_tokens: int = 1 << 20
    max_n: int = 16
    max_logit_bias: int = 300  # logit_bias entries per request (OpenAI's cap too)
    # Echo with logprobs: (logprobs + 1) entries per prompt token, summed over the prompts (n shares them).
    # 2^20 lets a full 128k-token context through at OpenAI's top 5 (786,432) and a 48k one at our top 20,
    # while one request cannot make the server build and send an unbounded pile of them.
    max_prompt_logprobs_entries: int = 1 << 20
    max_tokens: int | None = None  # cap on max_tokens; None: max_model_len
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    max_prompts_per_request: int = 64  # completions with a list of prompts
    max_body_bytes: int = 4 << 20
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    engine_stall_timeout_s: float = 300.0  # in-flight requests and no engine report this long fail /health
    request_timeout_s: float | None = None  # a request still running this long after arrival ends with a 504
    max_queue_time_s: float | None = None  # a request with no output yet this long after arrival ends with a 504
    engine_in_thread: bool = False  # run the engine core on a thread of the server process, not its own
    max_engine_restarts: int = 5  # engine deaths restarted per 10 minutes; beyond (or 0) the engine stays dead
    # New requests get 503 while both the KV cache's usage and the queued prompt tokens (as a share of the
    # cache's capacity) are at least this; None: they always queue (up to --max-waiting-*)
    memory_pressure_threshold: float | None = 0.95
    metrics_public: bool = False  # once API keys are set, /metrics needs one too unless this
    priority_keys: tuple[str, ...] = ()  # only these API keys' `priority` counts; others' count as 0
    # "shared": one prefix cache for all (a request's cache_salt still separates it); "per-key": every
    # request is salted with its API key, so no key's prompts hit (or reveal) another key's cache
    prefix_cache_isolation: str = "shared"
    max_failed_logins: int = 10  # 401s from one address per minute before it is answered 429
    audit_log: str | None = None  # a JSON line per finished completion/chat request is appended here
    audit_log_content: bool = False  # the audit lines carry prompts and outputs too
    limit_concurrency: int | None = None  # uvicorn answers 503 beyond this many open connections/tasks
    body_read_timeout_s: float | None = 30.0  # a request's body must arrive within this, else 408; None: no limit
    # A request's headers must arrive within this of the connection opening (or of the request's first byte
    # on a kept-alive one), else 408 and close. 20 s, Apache mod_reqtimeout's first deadline: headers are a few
    # hundred bytes sent in one round trip, so even a slow link needs a fraction of it, and a slow-loris
    # client must reconnect every 20 s instead of holding a socket forever.
    header_read_timeout_s: float = 20.0
    # How tool calls are found in free text (tool_choice "auto"): the format the model's chat template
    # teaches it (tool_parsers.TOOL_PARSERS); None: "auto" is refused (400)
    tool_call_parser: str | None = None
    # Operations (the dashboard, alerts and Grafana draw these as lines): latency SLOs, the throughput
    # (total tokens/s) the alerts compare with (None: the dashboard's best recent minute), $ per hour
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    throughput_baseline: float | None = None
    cost_per_hour: float | None = None
    dashboard: bool = True  # serve /dashboard and /dashboard/data
    log_format: str = "text"  # "json": one JSON object per log line
    otlp_traces_endpoint: str | None = None  # export per-request spans there (OTLP over HTTP)
    # Several models beside the default one (--registry, --extra-model), loaded on demand
    models: PoolConfig = field(default_factory=PoolConfig)

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
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}")

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
        return cls(
            config,
            engine,
            name,
            metrics,
            ApiKeys(config.keys(), config.priority_keys),
            RateLimiter(config.requests_per_min, config.tokens_per_min),
            LoginThrottle(config.max_failed_logins),
        )

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

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and not self.routed:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}.",
                "model_not_found",
                "model",
            )

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica.", "shutting_down")
        if self.engine.is_dead:
            raise APIError(503, "the engine has stopped (restarts spent); the server must be restarted.", "engine_dead")


def default_model_name(engine: AsyncEngine) -> str:
    from pathlib import Path

    return Path(engine.config.model.model).name or engine.config.model.model
