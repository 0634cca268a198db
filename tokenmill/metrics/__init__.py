"""Serving metrics: Prometheus collectors fed by the async engine (prometheus.py) and the operator's
extras (operations.py: batch sizes, KV blocks, errors, process and cost figures); the Grafana board's
generator (grafana.py), JSON logs (logs.py) and request spans (tracing.py)."""

from tokenmill.metrics.prometheus import ServerMetrics

__all__ = ["ServerMetrics"]
