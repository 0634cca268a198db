"""`tokenmill bench calibrate --server URL`: measure what engine steps cost while a live server serves.

Offline calibration times the engine alone; a served engine shares the machine with the server's event loop
(HTTP, detokenization, streaming) and the load generator, and on a small CPU that makes every step slower.
Here the workload's requests go to the server through `bench serve`'s client at a few concurrencies (each
a window). Before and after each window the server's step counters (tokenmill:engine_step_*, by kind:
decode, prefill, mixed) are read, and the planner's step model is fitted to the averages
(tokenmill/planner/step_fit.py).
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import httpx

from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.serve import run_load
from tokenmill.planner.step_fit import StepSample, fit_step_costs

CONCURRENCIES = (1, 4, 16, 64)
_COUNTERS = {
    "engine_step_seconds_count": "steps",
    "engine_step_seconds_sum": "seconds",
    "engine_step_decode_rows_total": "rows",
    "engine_step_prefill_tokens_total": "tokens",
}
_LINE = re.compile(r"^tokenmill:(\w+)\{([^}]*)\} (\S+)$")


def read_step_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """{kind: {steps, seconds, rows, tokens}} from a /metrics page."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        match = _LINE.match(line)
        if match is None or match[1] not in _COUNTERS:
            continue
        kind = re.search(r'kind="(\w+)"', match[2])
        if kind is not None:
            out.setdefault(kind[1], {})[_COUNTERS[match[1]]] = float(match[3])
    if not out:
        raise ValueError("the server exports no tokenmill:engine_step_* metrics; is it a tokenmill server?")
    return out


def window_samples(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> list[StepSample]:
    """One sample per kind of step that ran between two readings."""
    samples = []
    for kind, end in after.items():
        start = before.get(kind, {})
        grown = {k: end.get(k, 0.0) - start.get(k, 0.0) for k in _COUNTERS.values()}
        if grown["steps"] > 0:
            samples.append(
                StepSample(round(grown["steps"]), grown["seconds"], round(grown["rows"]), round(grown["tokens"]))
            )
    return samples


def served_model(base_url: str, api_key: str | None) -> str:
    """The server's first model id (what `bench serve` sends by default)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def window_sizes(max_num_seqs: int) -> list[tuple[int, int]]:
    """(concurrency, requests) per window: CONCURRENCIES up to max_num_seqs, each with twice its concurrency
    of requests (at least 3), so that most of a window's steps run at that concurrency."""
    return [(c, max(3, 2 * c)) for c in CONCURRENCIES if c <= max_num_seqs]


def calibrate_server(
    base_url: str, model: str, requests: list[BenchRequest], max_num_seqs: int, api_key: str | None = None
) -> dict[str, Any]:
    """The step costs fitted over the windows of `window_sizes`, and the windows' measurements. Each request
    is sent once (a repeated prompt would be served from the prefix cache); windows past the end of
    `requests` are shorter, or left out."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def counters() -> dict[str, dict[str, float]]:
        response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30)
        response.raise_for_status()
        return read_step_counters(response.text)

    windows: list[dict[str, Any]] = []
    samples: list[StepSample] = []
    start = 0
    for concurrency, count in window_sizes(max_num_seqs):
        batch = requests[start : start + count]
        start += len(batch)
        if not batch:
            break
        before = counters()
        results, duration = asyncio.run(run_load(base_url, model, batch, math.inf, concurrency, 0, api_key))
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"a calibration request failed: {failed[0]}")
        window = window_samples(before, counters())
        samples += window
        windows.append({"concurrency": concurrency, "requests": len(batch), "wall_s": duration, "steps": window})
    return {
        "costs": fit_step_costs(samples),
        "windows": [w | {"steps": [s.__dict__ for s in w["steps"]]} for w in windows],
    }
