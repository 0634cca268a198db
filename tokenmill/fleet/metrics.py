"""The fleet's Prometheus metrics: the router's decisions and the replica counts (kept by the process
that routes, the ingress), plus every replica's own metrics with a `replica` label added.

Replicas hand their metrics text to the router with their routing stats (every few seconds), so the
fleet's /metrics shows each replica as of its last report; no scrape reaches into replicas."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tokenmill.metrics.prometheus import FLEET_REPLICA_STATES, fleet_replicas_gauge

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?( .*)$")
_FLEET_ONLY = ("tokenmill:fleet_replicas",)  # a replica's own value (1) is not the fleet's


class FleetMetrics:
    """One per routing process; the router and the ingress update it."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "tokenmill:router_decisions_total",
            "Requests routed, by decision: affinity (to a replica holding their prompt prefix) or least_loaded.",
            ["model_name", "decision"],
            registry=self.registry,
        )
        self.retries = Counter(
            "tokenmill:router_retries_total",
            "Requests sent again to another replica after theirs failed before any output.",
            ["model_name"],
            registry=self.registry,
        )
        self.prefill_hops = Counter(
            "tokenmill:router_prefill_hops_total",
            "Requests of a disaggregated fleet by their prefill hop: prefilled (a prefill replica computed the "
            "prompt), failed (the decode replica computed it), skipped (short prompt, or not completions/chat).",
            ["model_name", "outcome"],
            registry=self.registry,
        )
        self.replica_load = Gauge(
            "tokenmill:router_replica_load_tokens",
            "Queued and running tokens (prompt + max_tokens) per replica, as the router counts them.",
            ["model_name", "replica"],
            registry=self.registry,
        )
        self.replicas = fleet_replicas_gauge(self.registry)
        # Each router of this process adds its replicas' last routing stats here (Ray Serve creates
        # the routers; this shared object is how the ingress finds them).
        self.stats_sources: list[Callable[[], dict[str, dict[str, Any]]]] = []

    @classmethod
    def for_model(cls, model_name: str) -> FleetMetrics:
        """This process's metrics for the model (the router and the ingress share them)."""
        if model_name not in _PROCESS_METRICS:
            _PROCESS_METRICS[model_name] = cls(model_name)
        return _PROCESS_METRICS[model_name]

    def decided(self, affinity: bool) -> None:
        self.decisions.labels(self.model_name, "affinity" if affinity else "least_loaded").inc()

    def set_replicas(self, current: int, target: int, minimum: int, maximum: int) -> None:
        for state, value in zip(FLEET_REPLICA_STATES, (current, target, minimum, maximum)):
            self.replicas.labels(self.model_name, state).set(value)

    def render(self) -> bytes:
        """This registry, then each replica's metrics with replica="<id>" on every sample."""
        texts = {name: str(s.get("metrics", "")) for source in self.stats_sources for name, s in source().items()}
        return generate_latest(self.registry) + merge_replica_metrics(texts).encode()


_PROCESS_METRICS: dict[str, FleetMetrics] = {}


def merge_replica_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one: HELP/TYPE lines once per metric, every sample
    labelled with its replica, and the samples of one metric family kept together."""
    families: dict[str, list[str]] = {}  # family (from its HELP line) -> lines
    for replica, text in sorted(texts.items()):
        family = ""
        for line in text.splitlines():
            if line.startswith("# "):  # "# HELP name ..." or "# TYPE name ..."
                family = line.split(" ", 3)[2]
                if not family.startswith(_FLEET_ONLY) and line not in families.setdefault(family, []):
                    families[family].append(line)
            elif line and not family.startswith(_FLEET_ONLY):
                families.setdefault(family, []).append(_with_replica(line, replica))
    return "".join(line + "\n" for lines in families.values() for line in lines)


def _with_replica(sample: str, replica: str) -> str:
    match = _SAMPLE.match(sample)
    if match is None:
        return sample
    name, _, labels, rest = match.groups()
    label = f'replica="{replica}"'
    return f"{name}{{{label},{labels}}}{rest}" if labels else f"{name}{{{label}}}{rest}"
