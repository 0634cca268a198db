"""Prometheus metrics under vLLM's names, prefixed `tokenmill:`, so dashboards built for one read the other.

`ServerMetrics` is the async engine's `StatsListener`: it hears every step snapshot, every batch of
new tokens and every finished request (all on the event loop), and keeps its own registry so that
several servers can live in one process (tests)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.engine.async_engine import EngineSnapshot, RequestStream
from tokenmill.metrics.operations import OperationsMetrics
from tokenmill.outputs import RequestOutput

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


FLEET_REPLICA_STATES = ("current", "target", "min", "max")


def fleet_replicas_gauge(registry: CollectorRegistry) -> Gauge:
    """tokenmill:fleet_replicas{model_name, state}: replicas serving the model, by FLEET_REPLICA_STATES."""
    return Gauge(
        "tokenmill:fleet_replicas",
        "Replicas serving this model: current (running), target (the autoscaler's), min and max.",
        ["model_name", "state"],
        registry=registry,
    )


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenmill:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"tokenmill:{name}", doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenmill:{name}", doc, labels, buckets=buckets, registry=self.registry)

        m = model_name
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.").labels(m)
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.").labels(m)
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.").labels(m)
        self.prompt_throughput = gauge(
            "avg_prompt_throughput_toks_per_s", "Prompt tokens per second over the last interval."
        ).labels(m)
        self.generation_throughput = gauge(
            "avg_generation_throughput_toks_per_s", "Generated tokens per second over the last interval."
        ).labels(m)
        self.num_preemptions = counter("num_preemptions", "Requests preempted (to be recomputed).").labels(m)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(m)
        self._request_success = counter("request_success", "Requests finished, by finish reason.", ("finished_reason",))
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(m)
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(m)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS).labels(m)
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between a request's consecutive tokens.", _LATENCY_BUCKETS
        ).labels(m)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS).labels(m)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time in the waiting queue.", _REQUEST_BUCKETS
        ).labels(m)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS
        ).labels(m)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", _REQUEST_BUCKETS).labels(
            m
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", _TOKEN_BUCKETS
        ).labels(m)
        # Speculative decoding (vLLM's spec_decode_*): acceptance rate = accepted / draft tokens; mean
        # accepted length = 1 + accepted / drafts.
        self.spec_num_drafts = counter(
            "spec_decode_num_drafts", "Request-steps that verified speculative draft tokens."
        ).labels(m)
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.").labels(m)
        self.spec_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted (equal to the target's own choice)."
        ).labels(m)
        self._spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position (0-based) was accepted.",
            ("position",),
        )
        # The second KV tier (--kv-offloading-size); mean load latency = load_seconds / loads.
        self.kv_tier_counters = {
            field: counter(f"kv_tier_{field}", doc).labels(m)
            for field, doc in (
                ("hit_tokens", "Prompt tokens loaded from the second KV tier instead of recomputed."),
                ("blocks_loaded", "KV blocks read back from the second tier."),
                ("load_failures", "Tier blocks missing, truncated or corrupt when loaded (misses, recomputed)."),
                ("blocks_saved", "KV blocks written to the second tier."),
                ("blocks_dropped", "Evicted KV blocks not saved: the tier's writer was behind."),
                ("bytes_written", "Bytes written to the second KV tier."),
                ("bytes_read", "Bytes read from the second KV tier."),
                ("load_seconds", "Seconds steps spent loading blocks from the second KV tier."),
                ("loads", "Requests whose prefix was read from the second KV tier."),
            )
        }
        self.kv_tier_blocks = gauge("kv_tier_blocks", "KV blocks held in the second tier.").labels(m)
        self.kv_tier_capacity_blocks = gauge(
            "kv_tier_capacity_blocks", "KV blocks the second tier holds at most."
        ).labels(m)
        self.engine_restarts = counter(
            "engine_restarts", "New engines started after one died (killed, or model steps failing in a row)."
        ).labels(m)
        # One replica here; on Ray Serve the fleet's ingress exports the real counts (tokenmill.fleet).
        self.fleet_replicas = fleet_replicas_gauge(self.registry)
        for state in FLEET_REPLICA_STATES:
            self.fleet_replicas.labels(m, state).set(1)
        self.ops = OperationsMetrics(self.registry, model_name)
        self.model_name = model_name
        self._last = _Totals(time.monotonic(), 0, 0, 0)
        self._prev_snapshot: EngineSnapshot | None = None
        self._totals = _Totals(time.monotonic(), 0, 0, 0)

    # ------------------------------------------------------------------ the StatsListener side
    def on_step(self, snapshot: EngineSnapshot) -> None:
        prev = self._prev_snapshot
        self._prev_snapshot = snapshot
        self.num_requests_running.set(snapshot.num_running)
        self.num_requests_waiting.set(snapshot.num_waiting)
        self.kv_cache_usage.set(snapshot.kv_cache_usage)
        if snapshot.num_step_tokens:
            self.iteration_tokens.observe(snapshot.num_step_tokens)
        self.ops.on_step(snapshot)
        self._totals.steps += 1
        # The snapshot's counts are cumulative since the engine started: export what grew since the last.

        def grown(count: Callable[[EngineSnapshot], float]) -> float:
            return max(0, count(snapshot) - (count(prev) if prev is not None else 0))

        self.num_preemptions.inc(grown(lambda s: s.num_preemptions))
        self.prefix_cache_queries.inc(grown(lambda s: s.prefix_cache_queries))
        self.prefix_cache_hits.inc(grown(lambda s: s.prefix_cache_hits))
        self.spec_num_drafts.inc(grown(lambda s: s.spec_num_drafts))
        self.spec_num_draft_tokens.inc(grown(lambda s: s.spec_num_draft_tokens))
        self.spec_num_accepted_tokens.inc(grown(lambda s: s.spec_num_accepted_tokens))
        before = prev.spec_accepted_per_pos if prev is not None else ()
        for pos, count in enumerate(snapshot.spec_accepted_per_pos):
            # inc(0) too: a position's series appears (at 0) once its first draft is verified
            old = before[pos] if pos < len(before) else 0
            self._spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(max(0, count - old))
        tier = snapshot.kv_tier
        if tier is not None:
            before_tier = prev.kv_tier if prev is not None else None
            for field, metric in self.kv_tier_counters.items():
                old_value = getattr(before_tier, field) if before_tier is not None else 0
                metric.inc(max(0, getattr(tier, field) - old_value))
            self.kv_tier_blocks.set(tier.num_blocks)
            self.kv_tier_capacity_blocks.set(tier.capacity_blocks)

    def on_tokens(self, stream: RequestStream, num_new_tokens: int, now: float) -> None:
        self.ops.on_tokens(stream, num_new_tokens)
        if stream.first_token_time is None:
            self.ttft.observe(now - stream.arrival_time)
            self.prompt_tokens.inc(stream.num_prompt_tokens)
            self._totals.prompt_tokens += stream.num_prompt_tokens
        elif stream.last_token_time is not None:
            self.itl.observe(now - stream.last_token_time)
        self.generation_tokens.inc(num_new_tokens)
        self._totals.generation_tokens += num_new_tokens

    def on_finished(self, stream: RequestStream, output: RequestOutput) -> None:
        reasons = [o.finish_reason or "abort" for o in output.outputs]
        reason = "error" if output.error else ("abort" if "abort" in reasons else reasons[0])
        self._request_success.labels(self.model_name, reason).inc()
        self.ops.on_finished(stream, output)
        self.e2e.observe(time.monotonic() - stream.arrival_time)
        m = stream.metrics()
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
                if m.finished_time is not None:
                    self.decode_time.observe(max(0.0, m.finished_time - m.first_token_time))

    def on_restart(self) -> None:
        self.engine_restarts.inc()
        self._prev_snapshot = None  # the new engine's cumulative counts start again from 0

    # ------------------------------------------------------------------ periodic and scrape
    def log_throughput(self) -> None:
        """Update the throughput gauges over the interval since the last call, and log them when busy."""
        now, totals, last = time.monotonic(), self._totals, self._last
        elapsed = max(now - last.time, 1e-9)
        prompt_tps = (totals.prompt_tokens - last.prompt_tokens) / elapsed
        gen_tps = (totals.generation_tokens - last.generation_tokens) / elapsed
        self.prompt_throughput.set(prompt_tps)
        self.generation_throughput.set(gen_tps)
        if totals.steps != last.steps:
            snap = self._prev_snapshot
            logger.info(
                "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
                "KV cache %.1f%%",
                prompt_tps,
                gen_tps,
                snap.num_running if snap else 0,
                snap.num_waiting if snap else 0,
                100 * (snap.kv_cache_usage if snap else 0.0),
            )
        self._last = _Totals(now, totals.prompt_tokens, totals.generation_tokens, totals.steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Totals:
    def __init__(self, when: float, prompt_tokens: int, generation_tokens: int, steps: int) -> None:
        self.time = when
        self.prompt_tokens = prompt_tokens
        self.generation_tokens = generation_tokens
        self.steps = steps
