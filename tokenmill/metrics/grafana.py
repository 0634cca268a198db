"""The Grafana dashboard shipped at deploy/grafana/tokenmill.json, generated here with the live
dashboard's ten panels, and its check:

    python -m tokenmill.metrics.grafana           # write deploy/grafana/tokenmill.json
    python -m tokenmill.metrics.grafana --check   # exit 1 if the file is stale or names an unknown metric

A query may name a metric `ServerMetrics` registers (with the suffixes Prometheus adds) or a series
recorded by deploy/prometheus/alerts.yml."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tokenmill.json"
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
_METRIC = re.compile(r"\btokenmill:[A-Za-z0-9_:]+")
_SEL = '{model_name=~"$model_name"}'  # every query follows the dashboard's model picker
_BY = "by (instance, model_name)"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


@dataclass(frozen=True)
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    thresholds: list[float] = field(default_factory=list)


def _rate(name: str, window: str = "1m") -> str:
    return f"sum {_BY} (rate({name}{_SEL}[{window}]))"


def _quantile(q: float, name: str) -> str:
    return f"histogram_quantile({q}, sum by (le, model_name) (rate({name}_bucket{_SEL}[1m])))"


def panels() -> list[Panel]:
    t = "tokenmill:"
    tokens = f"{_rate(t + 'prompt_tokens_total')} + {_rate(t + 'generation_tokens_total')}"
    return [
        Panel(
            "1 · Throughput (tokens/s) with baseline",
            [
                (tokens, "{{instance}} tokens/s"),
                (f"{t}throughput_toks_per_s:baseline{_SEL}", "{{instance}} baseline"),
                (f"0.7 * {t}throughput_toks_per_s:baseline{_SEL}", "warning (70%)"),
            ],
        ),
        Panel(
            "2 · Throughput by phase and route",
            [
                (_rate(t + "prompt_tokens_total"), "prefill {{instance}}"),
                (_rate(t + "generation_tokens_total"), "decode {{instance}}"),
                (f"sum by (route, phase) (rate({t}route_tokens_total{_SEL}[1m]))", "{{route}} {{phase}}"),
            ],
        ),
        Panel(
            "3 · Batch size",
            [
                (f"sum(rate({t}batch_size_sum{_SEL}[1m])) / sum(rate({t}batch_size_count{_SEL}[1m]))", "mean"),
                (_quantile(0.9, t + "batch_size"), "p90"),
                (f"sum by (le) (increase({t}batch_size_bucket{_SEL}[5m]))", "le {{le}}"),
            ],
        ),
        Panel(
            "4 · Memory: KV blocks and process RSS",
            [
                (f"sum by (state) ({t}kv_cache_blocks{_SEL})", "KV {{state}} blocks"),
                (f"sum {_BY} ({t}kv_tier_blocks{_SEL})", "{{instance}} KV tier blocks"),
                (f"sum by (process) ({t}process_resident_memory_bytes{_SEL}) / 2^20", "{{process}} RSS MiB"),
            ],
        ),
        Panel(
            "5 · Latency percentiles with SLOs",
            [
                (_quantile(0.5, t + "time_to_first_token_seconds"), "TTFT p50"),
                (_quantile(0.99, t + "time_to_first_token_seconds"), "TTFT p99"),
                (_quantile(0.99, t + "inter_token_latency_seconds"), "ITL p99"),
                (_quantile(0.99, t + "e2e_request_latency_seconds"), "E2E p99"),
                (f"max by (metric) ({t}slo_seconds{_SEL})", "SLO {{metric}}"),
            ],
            unit="s",
        ),
        Panel(
            "6 · Queue depth and queue time",
            [
                (f"sum {_BY} ({t}num_requests_waiting{_SEL})", "waiting {{instance}}"),
                (f"sum {_BY} ({t}num_requests_running{_SEL})", "running {{instance}}"),
                (_quantile(0.5, t + "request_queue_time_seconds"), "queue time p50 (s)"),
                (_quantile(0.99, t + "request_queue_time_seconds"), "queue time p99 (s)"),
            ],
        ),
        Panel(
            "7 · Device utilization",
            [
                (f"sum by (instance, process) ({t}cpu_busy_cores{_SEL})", "{{instance}} {{process}} CPU cores"),
                (f"max {_BY} ({t}gpu_utilization_perc{_SEL})", "{{instance}} GPU busy"),
                (f"max {_BY} ({t}gpu_memory_used_bytes{_SEL}) / 2^30", "{{instance}} GPU GiB"),
                (f"{_rate(t + 'engine_step_bytes_read_total')} / 1e9", "{{instance}} memory GB/s (steps, estimated)"),
                (f"max {_BY} ({t}memory_bandwidth_utilization{_SEL})", "{{instance}} memory bandwidth used (0-1)"),
            ],
        ),
        Panel(
            "8 · Errors by type (per s)",
            [(f"sum by (type) (rate({t}request_errors_total{_SEL}[1m]))", "{{type}}")],
        ),
        Panel(
            "9 · Scaling (replicas)",
            [(f"max by (state) ({t}fleet_replicas{_SEL})", "{{state}}")],
        ),
        Panel(
            "10 · Cost efficiency",
            [
                (f"avg {_BY} ({t}cost_per_million_tokens_dollars{_SEL})", "{{instance}} $ per 1M tokens"),
                (f"({tokens}) / {t}throughput_toks_per_s:baseline{_SEL}", "{{instance}} utilization"),
            ],
        ),
    ]


def build(items: list[Panel] | None = None) -> dict[str, Any]:
    items = panels() if items is None else items
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    out = []
    for i, p in enumerate(items):
        out.append(
            {
                "id": i + 1,
                "type": p.kind,
                "title": p.title,
                "datasource": datasource,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + j), "datasource": datasource, "expr": expr, "legendFormat": legend}
                    for j, (expr, legend) in enumerate(p.targets)
                ],
            }
        )
    return {
        "title": "tokenmill",
        "uid": "tokenmill",
        "tags": ["tokenmill", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "model_name",
                    "type": "query",
                    "datasource": datasource,
                    "query": "label_values(tokenmill:num_requests_running, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": out,
    }


def render(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


def exported_names(registry: CollectorRegistry | None = None) -> set[str]:
    """Every series name the server exports (a fresh `ServerMetrics`' registry unless one is given)."""
    if registry is None:
        from tokenmill.metrics.prometheus import ServerMetrics

        registry = ServerMetrics("check").registry
    return {family.name + s for family in registry.collect() for s in _SUFFIXES.get(family.type, ("",))}


def recorded_names(rules: Path = RULES) -> set[str]:
    return set(re.findall(r"^\s*-?\s*record:\s*(\S+)", rules.read_text(), re.MULTILINE)) if rules.exists() else set()


def unknown_metrics(dashboard: dict[str, Any], known: set[str]) -> list[str]:
    """`panel title: metric` for every metric a query names that is not in `known`."""
    return [
        f"{panel['title']}: {name}"
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in _METRIC.findall(target["expr"])
        if name not in known
    ]


def check(path: Path = DASHBOARD, dashboard: dict[str, Any] | None = None) -> list[str]:
    """Problems with the file at `path` (empty when it is fresh and every metric exists)."""
    dashboard = build() if dashboard is None else dashboard
    problems = [f"unknown metric in {u}" for u in unknown_metrics(dashboard, exported_names() | recorded_names())]
    if not path.exists() or path.read_text() != render(dashboard):
        problems.append(f"{path} is stale: run python -m tokenmill.metrics.grafana")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the file is stale or names unknown metrics")
    parser.add_argument("--out", type=Path, default=DASHBOARD)
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    unknown = unknown_metrics(build(), exported_names() | recorded_names())
    if unknown:
        print("\n".join(f"unknown metric in {u}" for u in unknown), file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(build()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
