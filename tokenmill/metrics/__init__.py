"""Serving metrics: Prometheus collectors fed by the async engine (prometheus.py)."""

from tokenmill.metrics.prometheus import ServerMetrics

__all__ = ["ServerMetrics"]
