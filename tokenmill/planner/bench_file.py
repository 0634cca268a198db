"""Read a workload and a measured throughput from a `tokenmill bench throughput --output-json` file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_HINT = "pass a file written by `tokenmill bench throughput --output-json FILE.json`"


@dataclass(frozen=True)
class BenchMeasurement:
    """Means per request and the total (prompt + output) tokens/s one engine sustained."""

    path: str
    avg_input_tokens: float
    avg_output_tokens: float
    total_tok_s: float


def load_bench(path: str | Path) -> BenchMeasurement:
    """The measurement in `path`'s "results" (prompt_tokens, output_tokens, num_requests, total_tok_s)."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read --from-bench {path}: {exc.strerror}; {BENCH_HINT}.") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--from-bench {path} is not JSON ({exc.msg}); {BENCH_HINT}.") from exc
    results = report.get("results") if isinstance(report, dict) else None
    if not isinstance(results, dict):
        raise ValueError(f'--from-bench {path} has no "results" object; {BENCH_HINT}.')
    num_requests = _number(results, "num_requests", path)
    if num_requests <= 0:
        raise ValueError(f"--from-bench {path} ran no requests (num_requests = {num_requests}); {BENCH_HINT}.")
    return BenchMeasurement(
        path=str(path),
        avg_input_tokens=_number(results, "prompt_tokens", path) / num_requests,
        avg_output_tokens=_number(results, "output_tokens", path) / num_requests,
        total_tok_s=_number(results, "total_tok_s", path),
    )


def _number(results: dict[str, Any], key: str, path: Path) -> float:
    value = results.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"--from-bench {path} has no number at results.{key}; {BENCH_HINT}.")
    return float(value)
