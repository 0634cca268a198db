"""The operator's metrics beyond vLLM's set: batch sizes, the KV block breakdown, errors by type, tokens
by route, process CPU and memory, the engine's steps and the memory bandwidth they draw, GPU use, SLO and
cost settings. They share `ServerMetrics`' registry, so /metrics and the dashboard read one set of numbers.

Step-driven ones are fed by `ServerMetrics` (on_step / on_tokens); process, device and cost gauges are
refreshed by `sample()`, which the dashboard's sampler calls once a second."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.engine.async_engine import EngineSnapshot, RequestStream
from tokenmill.metrics.bandwidth import BandwidthGauges, load_measured_bandwidth
from tokenmill.metrics.process_stats import ProcessSampler, gpu_stats
from tokenmill.metrics.step_metrics import StepMetrics
from tokenmill.metrics.tracing import RequestTracer
from tokenmill.outputs import RequestOutput

logger = logging.getLogger(__name__)

ERROR_TYPES = ("validation", "unauthorized", "rate_limited", "queue_full", "timeout", "engine_error", "out_of_memory")
ROUTES = {"chatcmpl": "/v1/chat/completions", "cmpl": "/v1/completions"}  # request-id prefix -> route
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class OperatorSettings:
    """What the operator told the server (flags), exported so that Grafana and alerts can draw the lines."""

    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    throughput_baseline: float | None = None  # total tokens/s; None: the dashboard uses a recent window
    cost_per_hour: float | None = None  # $ per replica-hour


class OperationsMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        m = model_name

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"tokenmill:{name}", doc, ["model_name", *extra], registry=registry)

        self.batch_size = Histogram(
            "tokenmill:batch_size",
            "Requests in the running batch after each engine step.",
            ["model_name"],
            buckets=_BATCH_BUCKETS,
            registry=registry,
        ).labels(m)
        self._kv_blocks = gauge(
            "kv_cache_blocks", "KV blocks by state: used, cached (free, prefix kept), free.", ("state",)
        )
        self._errors = Counter(
            "tokenmill:request_errors",
            "Requests answered with an error, by type.",
            ["model_name", "type"],
            registry=registry,
        )
        self._route_tokens = Counter(
            "tokenmill:route_tokens",
            "Tokens by route and phase (prefill: prompt tokens, decode: generated).",
            ["model_name", "route", "phase"],
            registry=registry,
        )
        self._cpu = gauge("cpu_busy_cores", "CPU cores busy (1.0 = one core) over the last second.", ("process",))
        self._rss = gauge("process_resident_memory_bytes", "Resident memory of the process.", ("process",))
        self.gpu_utilization = gauge("gpu_utilization_perc", "GPU busy share (0-1) over the last sample.").labels(m)
        self.gpu_memory = gauge("gpu_memory_used_bytes", "GPU memory allocated by the engine.").labels(m)
        self._slo = gauge("slo_seconds", "The latency SLOs given with --slo-ttft-ms / --slo-itl-ms.", ("metric",))
        self.throughput_baseline = gauge(
            "throughput_baseline_toks_per_s", "Total tokens/s the throughput alerts compare with (configured)."
        ).labels(m)
        self.cost_per_hour = gauge("cost_per_hour_dollars", "$ per replica-hour (--cost-per-hour).").labels(m)
        self.cost_per_million = gauge(
            "cost_per_million_tokens_dollars", "$ per 1M total tokens at the last minute's throughput."
        ).labels(m)
        self.engine_up = gauge(
            "engine_up", "1 while the engine serves; 0 while it restarts or once it is dead."
        ).labels(m)
        self.engine_up.set(1)
        self.model_name = m
        for kind in ERROR_TYPES:  # every type's series exists (at 0) from the start, so rate() sees the first
            self._errors.labels(m, kind)
        for route in ROUTES.values():
            for phase in ("prefill", "decode"):
                self._route_tokens.labels(m, route, phase)
        self.steps = StepMetrics(registry, m)
        self.bandwidth = BandwidthGauges(registry, m, load_measured_bandwidth())
        self._processes = ProcessSampler()
        self._settings = OperatorSettings()
        self.num_blocks = 0  # the KV cache's size, set once the engine is known (set_engine)
        self.tracer: RequestTracer | None = None  # per-request spans, with --otlp-traces-endpoint

    def configure(self, settings: OperatorSettings) -> None:
        self._settings = settings
        if settings.slo_ttft_s is not None:
            self._slo.labels(self.model_name, "ttft").set(settings.slo_ttft_s)
        if settings.slo_itl_s is not None:
            self._slo.labels(self.model_name, "itl").set(settings.slo_itl_s)
        if settings.throughput_baseline is not None:
            self.throughput_baseline.set(settings.throughput_baseline)
        if settings.cost_per_hour is not None:
            self.cost_per_hour.set(settings.cost_per_hour)

    def set_engine(self, pid: int | None, num_blocks: int) -> None:
        """The engine process to sample (None: the engine runs in this process) and its KV cache size."""
        self._processes.engine_pid = pid
        self.num_blocks = num_blocks

    # ------------------------------------------------------------------ fed by ServerMetrics
    def on_step(self, snapshot: EngineSnapshot) -> None:
        self.steps.on_step(snapshot)
        if snapshot.num_running:
            self.batch_size.observe(snapshot.num_running)
        cached_free = min(snapshot.num_cached_free_blocks, snapshot.num_free_blocks)
        used = max(0, self.num_blocks - snapshot.num_free_blocks)
        self._kv_blocks.labels(self.model_name, "used").set(used)
        self._kv_blocks.labels(self.model_name, "cached").set(cached_free)
        self._kv_blocks.labels(self.model_name, "free").set(snapshot.num_free_blocks - cached_free)

    def on_tokens(self, stream: RequestStream, num_new_tokens: int) -> None:
        route = ROUTES.get(stream.request_id.split("-", 1)[0], "other")
        if stream.first_token_time is None:
            self._route_tokens.labels(self.model_name, route, "prefill").inc(stream.num_prompt_tokens)
        self._route_tokens.labels(self.model_name, route, "decode").inc(num_new_tokens)

    def on_finished(self, stream: RequestStream, output: RequestOutput) -> None:
        if self.tracer is not None:
            try:
                self.tracer.on_finished(stream, output, self.model_name)
            except Exception:  # a tracing failure must never fail the request it describes
                logger.exception("could not record the spans of request %s", stream.request_id)

    def count_error(self, kind: str) -> None:
        self._errors.labels(self.model_name, kind).inc()

    # ------------------------------------------------------------------ sampled once a second
    def sample(self, total_tokens_per_s: float) -> None:
        """Refresh process, device and cost gauges; `total_tokens_per_s` is the last minute's throughput."""
        usage = self._processes.sample()
        self.bandwidth.sample(self.steps.bytes_read_total)
        for name, cores in usage.cpu_busy_cores.items():
            self._cpu.labels(self.model_name, name).set(cores)
        for name, rss in usage.rss_bytes.items():
            self._rss.labels(self.model_name, name).set(rss)
        gpu = gpu_stats()
        if gpu is not None:
            self.gpu_utilization.set(gpu.utilization)
            self.gpu_memory.set(gpu.memory_used_bytes)
        dollars = self._settings.cost_per_hour
        if dollars is not None and total_tokens_per_s > 0:
            self.cost_per_million.set(dollars / (total_tokens_per_s * 3600) * 1e6)
