"""`tokenmill bench serve`: a load generator against any OpenAI-compatible server (ours or another).

    tokenmill bench serve --base-url http://127.0.0.1:8000 --workload random-cpu --request-rate inf
    tokenmill bench serve --base-url URL --request-rate 2 --goodput ttft:2000 tpot:100 --output-json r.json
    tokenmill bench serve --base-url URL --sweep 0.5,1,2,inf --plot sweep.png

Requests are the standard workloads (token-id prompts sent to /v1/completions, `ignore_eos` with a fixed
`max_tokens`, streamed). Arrivals are Poisson at `--request-rate` (or all at once with `inf`), optionally
capped at `--max-concurrency` in flight. Metrics follow `vllm bench serve`: TTFT (send to first token),
TPOT ((E2EL - TTFT) / (output tokens - 1)), ITL (every gap between streamed chunks, pooled), E2EL (send
to last byte); output tokens are the server's own count (the usage field)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenmill.bench.datasets import TOKEN_WORKLOADS, BenchRequest, make_workload
from tokenmill.bench.report import add_cost_arg, cost_report, format_cost

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class ServeResult:
    request_rate: float
    max_concurrency: int | None
    duration_s: float
    completed: int
    failed: int
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    latency_ms: dict[str, dict[str, float]]  # metric -> {mean, median, p90, p99}
    errors: list[str]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return data


# ---------------------------------------------------------------------- one request
async def send_request(client: httpx.AsyncClient, model: str, req: BenchRequest) -> RequestResult:
    body = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": req.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_tokens=len(req.prompt_token_ids))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in data:
                    result.error = str(data["error"].get("message", data["error"]))[:200]
                    return result
                if data.get("usage"):
                    result.output_tokens = int(data["usage"].get("completion_tokens", 0))
                    result.prompt_tokens = int(data["usage"].get("prompt_tokens", result.prompt_tokens))
                if data.get("choices"):
                    if chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    chunks += 1
                    last = now
        result.e2el_s = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks  # servers without usage in streams
        result.ok = chunks > 0
        if not result.ok:
            result.error = "the stream carried no tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


# ---------------------------------------------------------------------- a run
async def run_load(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    seed: int = 0,
    api_key: str | None = None,
    timeout_s: float = 3600.0,
) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at `request_rate`/s, all at once if inf); returns the
    results in request order and the wall time from the first send to the last response."""
    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(requests)) if math.isinf(request_rate) else rng.exponential(1.0 / request_rate, len(requests))
    limit = max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)

    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0)
    ) as client:

        async def one(req: BenchRequest) -> RequestResult:
            async with semaphore:
                return await send_request(client, model, req)

        start = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps):
            if gap > 0:
                await asyncio.sleep(float(gap))
            tasks.append(asyncio.ensure_future(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(
    results: list[RequestResult],
    duration_s: float,
    request_rate: float,
    max_concurrency: int | None,
    goodput_slos_ms: dict[str, float] | None = None,
) -> ServeResult:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    series = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [t for r in ok if (t := r.tpot_s) is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2el_s for r in ok],
    }
    latency = {name: _stats_ms(values) for name, values in series.items()}
    goodput = None
    if goodput_slos_ms:
        good = sum(1 for r in ok if _meets(r, goodput_slos_ms))
        goodput = good / duration_s if duration_s > 0 else 0.0
    return ServeResult(
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        duration_s=duration_s,
        completed=len(ok),
        failed=len(results) - len(ok),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s if duration_s > 0 else 0.0,
        output_throughput=output_tokens / duration_s if duration_s > 0 else 0.0,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_s if duration_s > 0 else 0.0,
        goodput=goodput,
        latency_ms=latency,
        errors=sorted({r.error for r in results if not r.ok})[:10],
    )


def _meets(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2el_s}
    return all(values[name] * 1000 <= limit for name, limit in slos_ms.items())


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values) * 1000
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
    }


def format_result(result: ServeResult) -> str:
    rate = "inf" if math.isinf(result.request_rate) else f"{result.request_rate:g}"
    rows: list[tuple[str, str]] = [
        ("request rate (req/s)", rate),
        ("max concurrency", str(result.max_concurrency or "none")),
        ("successful requests", str(result.completed)),
        ("failed requests", str(result.failed)),
        ("duration (s)", f"{result.duration_s:.2f}"),
        ("prompt / output tokens", f"{result.prompt_tokens} / {result.output_tokens}"),
        ("request throughput (req/s)", f"{result.request_throughput:.2f}"),
        ("output throughput (tok/s)", f"{result.output_throughput:.1f}"),
        ("total throughput (tok/s)", f"{result.total_token_throughput:.1f}"),
    ]
    if result.goodput is not None:
        rows.append(("goodput (req/s)", f"{result.goodput:.2f}"))
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = result.latency_ms[name]
        rows.append(
            (
                f"{name.upper()} ms mean / median / p90 / p99",
                f"{s['mean']:.1f} / {s['median']:.1f} / {s['p90']:.1f} / {s['p99']:.1f}",
            )
        )
    width = max(len(n) for n, _ in rows)
    text = "\n".join(f"  {n:<{width}}  {v}" for n, v in rows)
    if result.errors:
        text += "\n  errors: " + "; ".join(result.errors)
    return text


# ---------------------------------------------------------------------- command line
def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `serve` to the `tokenmill bench` subcommands."""
    parser = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, E2EL, throughput, goodput)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    parser.add_argument("--model", default=None, help="model id to send (default: the server's first model)")
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token (default: $TOKENMILL_API_KEY)")
    parser.add_argument("--workload", default="random-cpu", choices=TOKEN_WORKLOADS)
    parser.add_argument("--num-prompts", type=int, default=None, help="override the workload's request count")
    parser.add_argument("--max-prompt-len", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument(
        "--vocab-size", type=int, default=32000, help="prompt token ids are drawn below min(this, 10000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrival times")
    parser.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (Poisson), or inf")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs that count a request as good, e.g. ttft:2000 tpot:100 (also e2el)",
    )
    parser.add_argument("--warmup-requests", type=int, default=1, help="short requests sent before timing")
    parser.add_argument("--sweep", default=None, help="comma-separated request rates (e.g. 0.5,1,2,inf)")
    parser.add_argument("--plot", type=Path, default=None, help="with --sweep: write the PNG here")
    parser.add_argument("--output-json", type=Path, default=None, help="write command, settings and results")
    add_cost_arg(parser)
    parser.set_defaults(func=cmd_serve)
    return parser


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be > 0 or inf, got {text}")
    return value


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"bad --goodput item {item!r}; use METRIC:MS with METRIC one of {SLO_METRICS}.")
        slos[name] = float(value)
    return slos


def cmd_serve(args: argparse.Namespace) -> None:
    import os

    api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY", "").split(",")[0] or None
    slos = parse_goodput(args.goodput)
    requests = make_workload(
        args.workload,
        args.vocab_size,
        seed=args.seed,
        num_requests=args.num_prompts,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
    )
    model = args.model or _first_model(args.base_url, api_key)
    rates = [_rate(r) for r in args.sweep.split(",")] if args.sweep else [args.request_rate]
    _warm_up(args.base_url, model, requests, args.warmup_requests, api_key)
    results = []
    for rate in rates:
        raw, duration = asyncio.run(
            run_load(args.base_url, model, requests, rate, args.max_concurrency, args.seed, api_key)
        )
        result = summarize(raw, duration, rate, args.max_concurrency, slos)
        print(f"\n{args.workload} against {args.base_url} ({model}), {len(requests)} requests")
        print(format_result(result), flush=True)
        if args.cost_per_hour is not None:
            print(format_cost(cost_report(args.cost_per_hour, result.output_throughput, result.total_token_throughput)))
        results.append(result)
    if args.sweep:
        plot_sweep(results, args.plot or Path("bench_serve_sweep.png"))
    if args.output_json:
        write_report(args, model, results, slos)


def _first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _warm_up(base_url: str, model: str, requests: list[BenchRequest], n: int, api_key: str | None) -> None:
    warm = [BenchRequest(r.prompt_token_ids[:16], min(r.output_len, 4), r.temperature) for r in requests[:n]]
    if warm:
        raw, _ = asyncio.run(run_load(base_url, model, warm, math.inf, None, 0, api_key))
        failed = [r.error for r in raw if not r.ok]
        if failed:
            raise RuntimeError(f"the warm-up request failed: {failed[0]}")


def write_report(
    args: argparse.Namespace, model: str, results: list[ServeResult], slos: dict[str, float] | None
) -> None:
    report = {
        "command": shlex.join(sys.argv),
        "base_url": args.base_url,
        "model": model,
        "workload": {
            "name": args.workload,
            "seed": args.seed,
            "num_requests": args.num_prompts,
            "max_prompt_len": args.max_prompt_len,
            "max_output_len": args.max_output_len,
        },
        "goodput_slos_ms": slos,
        "machine": _machine(),
        "results": [_with_cost(r.to_dict(), r, args.cost_per_hour) for r in results],
    }
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output_json}")


def _with_cost(data: dict[str, Any], result: ServeResult, cost_per_hour: float | None) -> dict[str, Any]:
    if cost_per_hour is None:
        return data
    return data | cost_report(cost_per_hour, result.output_throughput, result.total_token_throughput)


def _machine() -> dict[str, Any]:
    import os
    import platform

    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}


def plot_sweep(results: list[ServeResult], path: Path) -> None:
    """Output throughput against request rate, and latency against throughput (the curve's knee)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--sweep plots need matplotlib: pip install 'tokenmill[plot]'", file=sys.stderr)
        return
    finite = [r.request_rate for r in results if not math.isinf(r.request_rate)]
    inf_x = (max(finite) * 1.5) if finite else 1.0
    xs = [inf_x if math.isinf(r.request_rate) else r.request_rate for r in results]
    tput = [r.output_throughput for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(xs, tput, "o-")
    left.set_xlabel(
        "request rate (req/s; rightmost = inf)"
        if any(math.isinf(r.request_rate) for r in results)
        else "request rate (req/s)"
    )
    left.set_ylabel("output throughput (tok/s)")
    left.grid(alpha=0.3)
    for metric, style in (("tpot", "o-"), ("ttft", "s--")):
        for stat in ("median", "p99"):
            right.plot(
                tput,
                [r.latency_ms[metric][stat] for r in results],
                style,
                alpha=1.0 if stat == "median" else 0.5,
                label=f"{metric.upper()} {stat}",
            )
    right.set_xlabel("output throughput (tok/s)")
    right.set_ylabel("latency (ms)")
    right.set_yscale("log")
    right.legend()
    right.grid(alpha=0.3)
    fig.suptitle("tokenmill bench serve: throughput vs latency")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
