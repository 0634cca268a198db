"""One read of a Prometheus registry, flattened, with the lookups the dashboard needs: sums over
labels, histogram buckets and quantiles the way Prometheus' histogram_quantile computes them."""

from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client import CollectorRegistry

Labels = tuple[tuple[str, str], ...]


def sample_key(name: str, labels: dict[str, str]) -> str:
    """The series' name as the text format writes it, labels sorted: `name{a="1",b="2"}`."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


class Samples:
    """Every sample of a registry at one moment (the `_created` timestamps left out)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.series: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in registry.collect():
            for s in family.samples:
                if not s.name.endswith("_created"):
                    self.series[s.name].append((dict(s.labels), float(s.value)))

    def flat(self) -> dict[str, float]:
        return {sample_key(name, labels): value for name, rows in self.series.items() for labels, value in rows}

    def total(self, name: str, **match: str) -> float:
        """The sum over the series of `name` whose labels include `match`."""
        return sum(v for labels, v in self.series.get(name, ()) if all(labels.get(k) == x for k, x in match.items()))

    def by(self, name: str, label: str) -> dict[str, float]:
        """`name` summed per value of one label."""
        out: dict[str, float] = defaultdict(float)
        for labels, v in self.series.get(name, ()):
            if label in labels:
                out[labels[label]] += v
        return dict(out)

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """A histogram's cumulative (upper bound, count) pairs, summed over its other labels."""
        counts: dict[float, float] = defaultdict(float)
        for labels, v in self.series.get(f"{name}_bucket", ()):
            counts[float(labels["le"])] += v
        return sorted(counts.items())


def bucket_delta(new: list[tuple[float, float]], old: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The observations between two reads of one histogram (cumulative counts stay cumulative)."""
    before = dict(old)
    return [(le, count - before.get(le, 0.0)) for le, count in new]


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket holding the q-th observation; an
    observation in the +Inf bucket answers the largest finite bound. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def per_bucket(buckets: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Cumulative counts turned into each bucket's own count."""
    out, below = [], 0.0
    for le, count in buckets:
        out.append((le, count - below))
        below = count
    return out
