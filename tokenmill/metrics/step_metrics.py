"""What the engine's steps cost as they are served: their wall time, decode rows and prompt tokens, by kind,
and the memory they read (an estimate: the dashboard's memory-bandwidth figure is its rate).

Kinds: `decode` (decode rows only), `prefill` (prompt chunks only), `mixed` (both). Over a window,
`tokenmill bench calibrate --server URL` reads these counters before and after and fits the planner's
step-time model to what each kind's steps cost on average (tokenmill/planner/step_fit.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from tokenmill.engine.async_engine import EngineSnapshot

STEP_KINDS = ("decode", "prefill", "mixed")
_STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


def step_kind(decode_rows: int, prefill_tokens: int) -> str:
    if prefill_tokens == 0:
        return "decode"
    return "prefill" if decode_rows == 0 else "mixed"


class StepMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name", "kind"]
        self._seconds = Histogram(
            "tokenmill:engine_step_seconds",
            "Wall time of an engine step (schedule, model, sampling, bookkeeping), by kind.",
            labels,
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self._rows = Counter(
            "tokenmill:engine_step_decode_rows",
            "Decode rows (one new token each) in engine steps.",
            labels,
            registry=registry,
        )
        self._tokens = Counter(
            "tokenmill:engine_step_prefill_tokens", "Prompt tokens computed in engine steps.", labels, registry=registry
        )
        self.bytes_read = Counter(
            "tokenmill:engine_step_bytes_read",
            "Memory the engine's steps read, estimated: the weights once per step plus the KV cache attention reads.",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self.bytes_read_total = 0  # the counter's value, for the bandwidth gauge's rate
        self.model_name = model_name
        for kind in STEP_KINDS:  # every kind's series exists (at 0) from the start
            self._seconds.labels(model_name, kind)
            self._rows.labels(model_name, kind)
            self._tokens.labels(model_name, kind)

    def on_step(self, snapshot: EngineSnapshot) -> None:
        if snapshot.step_decode_rows == 0 and snapshot.step_prefill_tokens == 0:
            return  # no model step (commands only)
        kind = step_kind(snapshot.step_decode_rows, snapshot.step_prefill_tokens)
        self._seconds.labels(self.model_name, kind).observe(snapshot.step_seconds)
        self._rows.labels(self.model_name, kind).inc(snapshot.step_decode_rows)
        self._tokens.labels(self.model_name, kind).inc(snapshot.step_prefill_tokens)
        self.bytes_read.inc(snapshot.step_bytes_read)
        self.bytes_read_total += snapshot.step_bytes_read
