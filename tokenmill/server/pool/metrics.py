"""The pool's own metrics (loads, unloads, resident models), and one /metrics page for every engine:
each loaded model's ServerMetrics keeps its own registry, merged here family by family."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# Model loads take from about a second (tiny models) to minutes (large ones from a cold disk).
_LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class PoolMetrics:
    def __init__(self, registries: Callable[[], Iterable[CollectorRegistry]]) -> None:
        self.registry = CollectorRegistry()
        self.load_seconds = Histogram(
            "tokenmill:model_load_seconds",
            "From a model's load starting to its engine accepting requests (verify, spawn, weights, KV cache).",
            ["model_name"],
            buckets=_LOAD_BUCKETS,
            registry=self.registry,
        )
        self.unload_seconds = Histogram(
            "tokenmill:model_unload_seconds",
            "From an unload starting (after any drain) to its engine process having exited.",
            ["model_name"],
            buckets=_LOAD_BUCKETS,
            registry=self.registry,
        )
        self.models_loaded = Gauge(
            "tokenmill:models_loaded",
            "Models with a resident engine (loading, ready or draining).",
            registry=self.registry,
        )
        self._page = CollectorRegistry()
        self._page.register(_Merged(lambda: [self.registry, *registries()]))

    def render(self) -> bytes:
        return generate_latest(self._page)


class _Merged(Collector):
    """The families of several registries as one: the same family from two models becomes one family
    with both models' samples (their model_name labels differ), as Prometheus expects."""

    def __init__(self, registries: Callable[[], Iterable[CollectorRegistry]]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries():
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(family.samples)
        yield from families.values()
