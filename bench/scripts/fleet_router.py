"""The prefix-aware router against Ray Serve's default router (power of two choices), 2 replicas x 1 core
(issue 28).

Usage: .venv/bin/python bench/scripts/fleet_router.py [--model MODEL] [--num-prompts 64] [--request-rate inf]
           [--tenants 4] [--output bench/results/fleet_router.json]

For each router: `tokenmill serve MODEL --replicas 2 --fleet-router R`, then `tokenmill bench serve
--workload shared-prefix`. The prefix hit rate is the replicas' own (prefix-cache hit tokens / prompt
tokens looked up, summed over both replicas, from the fleet's /metrics before and after the run); the
router's affinity decisions are reported too (prefix-aware only).

`shared-prefix` has one prefix, which both replicas soon hold, so routing there is mostly balancing.
`--tenants K` adds a second load where affinity matters: K distinct 1,024-token prefixes (random token
ids, seeded), each request one of them plus 64 unique ids, 32 tokens out, interleaved, `--concurrency` in
flight; Ray's default router spreads each prefix over both replicas, which then both prefill it."""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from fleet_common import bench_serve, metric_sum, metrics, serving, write_result

ROUTERS = ("prefix-aware", "ray-default")


async def tenant_load(url: str, tenants: int, requests: int, concurrency: int) -> dict[str, Any]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 10_000) for _ in range(1024)] for _ in range(tenants)]
    prompts = [prefixes[i % tenants] + [rng.randrange(100, 10_000) for _ in range(64)] for i in range(requests)]
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(prompt: list[int]) -> int:
            async with gate:
                body = {"prompt": prompt, "max_tokens": 32, "ignore_eos": True}
                response = await client.post(f"{url}/v1/completions", json=body)
                response.raise_for_status()
                return int(response.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - start
    return {"tenants": tenants, "requests": requests, "duration_s": elapsed, "output_throughput": sum(tokens) / elapsed}


def grown(before: str, after: str, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def run_router(router: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    serve_args = [*args.model, "--replicas", "2", "--fleet-router", router, *args.serve_args.split()]
    with serving(serve_args, args.port, work / f"{router}.serve.log") as url:
        before = metrics(url)
        load = ["--workload", "shared-prefix", "--request-rate", args.request_rate, "--seed", "0"]
        if args.num_prompts:
            load += ["--num-prompts", str(args.num_prompts)]
        result = bench_serve(url, work / f"{router}.json", *load)
        after = metrics(url)
        tenants = None
        if args.tenants:
            tenants = asyncio.run(tenant_load(url, args.tenants, args.tenant_requests, args.concurrency))
            final = metrics(url)
            tenants["prefix_hit_rate"] = ratio(
                grown(after, final, "tokenmill:prefix_cache_hits_total"),
                grown(after, final, "tokenmill:prefix_cache_queries_total"),
            )
            tenants["router_affinity_rate"] = ratio(
                grown(after, final, "tokenmill:router_decisions_total", decision="affinity"),
                grown(after, final, "tokenmill:router_decisions_total"),
            )
    return {
        "router": router,
        "prefix_hit_rate": ratio(
            grown(before, after, "tokenmill:prefix_cache_hits_total"),
            grown(before, after, "tokenmill:prefix_cache_queries_total"),
        ),
        "router_affinity_rate": ratio(
            grown(before, after, "tokenmill:router_decisions_total", decision="affinity"),
            grown(before, after, "tokenmill:router_decisions_total"),
        ),
        "output_throughput": result["output_throughput"],
        "request_throughput": result["request_throughput"],
        "ttft_ms": result["latency_ms"].get("ttft"),
        "bench_serve": result,
        "tenants": tenants,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", nargs="*", default=[], help="model argument(s) of tokenmill serve (default: embedded)"
    )
    parser.add_argument("--serve-args", default="--max-model-len 2048", help="more tokenmill serve flags")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--tenants", type=int, default=4, help="distinct prefixes of the second load (0: skip it)")
    parser.add_argument("--tenant-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--port", type=int, default=8941)
    parser.add_argument("--output", default="fleet_router.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_router(router, args, Path(tmp)) for router in ROUTERS]
    for run in runs:
        ttft = run["ttft_ms"] or {}
        print(
            f"{run['router']:>13}: shared-prefix hit rate {run['prefix_hit_rate']}, "
            f"{run['output_throughput']:.1f} output tok/s, mean TTFT {ttft.get('mean')} ms; tenants: {run['tenants']}"
        )
    write_result(Path(args.output).name, {"workload": "shared-prefix", "replicas": 2, "runs": runs})


if __name__ == "__main__":
    main()
