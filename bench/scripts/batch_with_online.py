"""The Batch API beside online traffic (issue 46): does a big batch leave online requests' TTFT alone?

Usage: .venv/bin/python bench/scripts/batch_with_online.py [--port 8046] [--rate 2] [--duration 60] [--lines 1000]
           [--max-in-flight 4] [--server-args "--scheduling-policy priority"]
           [--output bench/results/xeon-amx/batch_with_online.json]

`tokenmill serve` on the embedded default model. An online load of streamed chat requests (short prompts,
max_tokens 16, greedy) arrives at a fixed rate (--rate per second, evenly spaced); each request's TTFT is the
time from sending it to its first chunk with content. Warm-up: a 40-line batch under the load for 15 s (the
first shapes, the caches). Phase 1: the load alone for --duration seconds. Phase 2: a --lines-request batch
file (short chat prompts, max_tokens 24) is uploaded and created, and the same load runs while the batch
does (until it completes, or --duration at most); the batch is then polled to completed. Reported: online
TTFT p50/p90/p99 per phase (and their p99 ratio, target <= 1.2) with the five slowest and when they were
sent, the batch's completion time (created -> completed) and its request_counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.hardware_info import cpu_model_name, isa_flags

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import ROOT, Server  # noqa: E402  (a sibling script: how a benchmark runs `tokenmill serve`)

TOPICS = ["the sea", "a mountain", "bread", "trains", "the moon", "a library", "rain", "coffee", "a garden", "music"]
QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number.",
    "What colour is the sky?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is two plus two?",
    "Name a planet.",
    "What do bees make?",
]
ONLINE_MAX_TOKENS, BATCH_MAX_TOKENS = 16, 24
WARM_UP_S, WARM_UP_LINES = 15.0, 40


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(samples: list[tuple[float, float]]) -> dict[str, Any]:
    """`samples`: (seconds into the phase the request was sent, its TTFT in seconds)."""
    ms = [t * 1000 for _, t in samples]
    worst = sorted(samples, key=lambda s: -s[1])[:5]
    return {
        "requests": len(ms),
        "ttft_ms_p50": round(percentile(ms, 50), 1),
        "ttft_ms_p90": round(percentile(ms, 90), 1),
        "ttft_ms_p99": round(percentile(ms, 99), 1),
        "ttft_ms_max": round(max(ms), 1),
        "ttft_ms_mean": round(statistics.fmean(ms), 1),
        # Where the tail came from: when in the phase each of the five slowest was sent.
        "worst_5_sent_at_s_ttft_ms": [[round(at, 1), round(t * 1000, 1)] for at, t in worst],
    }


async def one_request(client: httpx.AsyncClient, question: str) -> float:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": ONLINE_MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                delta = choices[0].get("delta", {})
                if delta.get("content") or choices[0].get("finish_reason"):
                    ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("a stream ended without content")
    return ttft


async def online_load(
    url: str, rate: float, stop: asyncio.Event, duration: float, seed: int
) -> list[tuple[float, float]]:
    """Requests every 1/rate seconds until `stop` is set or `duration` passes; (when sent, TTFT) each."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        start = time.perf_counter()
        while not stop.is_set() and time.perf_counter() - start < duration:
            tasks.append(asyncio.ensure_future(one_request(client, rng.choice(QUESTIONS))))
            next_at = start + len(tasks) / rate
            with_timeout = max(0.0, next_at - time.perf_counter())
            try:
                await asyncio.wait_for(stop.wait(), with_timeout)
            except asyncio.TimeoutError:
                pass
        ttfts = await asyncio.gather(*tasks)
    return [(i / rate, ttft) for i, ttft in enumerate(ttfts)]


def batch_file(lines: int) -> bytes:
    rows = []
    for i in range(lines):
        body = {
            "messages": [{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]} (#{i})."}],
            "max_tokens": BATCH_MAX_TOKENS,
            "temperature": 0,
        }
        rows.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(rows) + "\n").encode()


async def with_batch(url: str, rate: float, duration: float, lines: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        upload = await client.post(
            "/v1/files", files={"file": ("batch.jsonl", batch_file(lines))}, data={"purpose": "batch"}
        )
        upload.raise_for_status()
        created = await client.post(
            "/v1/batches",
            json={"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        created.raise_for_status()
        batch_id, started = created.json()["id"], time.perf_counter()
        stop = asyncio.Event()
        load = asyncio.ensure_future(online_load(url, rate, stop, duration, seed=2))
        progress_at_load_end: dict[str, Any] | None = None
        while True:
            batch = (await client.get(f"/v1/batches/{batch_id}")).json()
            if load.done() and progress_at_load_end is None:
                progress_at_load_end = batch["request_counts"]
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                break
            await asyncio.sleep(0.5)
        elapsed = time.perf_counter() - started
        stop.set()
        ttfts = await load
    return {
        "ttfts": ttfts,
        "batch": {
            "lines": lines,
            "status": batch["status"],
            "request_counts": batch["request_counts"],
            "completion_s": round(elapsed, 1),
            "lines_per_s": round(lines / elapsed, 2),
            "request_counts_when_online_load_ended": progress_at_load_end,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8046)
    parser.add_argument("--rate", type=float, default=2.0, help="online requests per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of online load per phase (at most)")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--max-in-flight", type=int, default=4, help="--batch-max-in-flight of the server")
    parser.add_argument("--server-args", default="", help="more `tokenmill serve` flags")
    parser.add_argument("--output", default=str(ROOT / "bench/results/xeon-amx/batch_with_online.json"))
    args = parser.parse_args()

    files_dir = tempfile.mkdtemp(prefix="tokenmill-bench-files-")
    server_args = ["--files-dir", files_dir, "--batch-max-in-flight", str(args.max_in_flight)]
    server_args += shlex.split(args.server_args)
    server = Server(args.port, server_args, Path(tempfile.gettempdir()) / "batch_with_online.serve.log")
    try:
        server.wait_ready()
        # Warm-up: a small batch under the load, so that every batch shape the phases meet has run once.
        warm = asyncio.run(with_batch(server.url, args.rate, WARM_UP_S, WARM_UP_LINES))
        print(f"warm-up: {len(warm['ttfts'])} online requests, a {WARM_UP_LINES}-line batch")
        alone = asyncio.run(online_load(server.url, args.rate, asyncio.Event(), args.duration, seed=1))
        print("online alone:", summary(alone))
        mixed = asyncio.run(with_batch(server.url, args.rate, args.duration, args.lines))
        print("online with the batch:", summary(mixed["ttfts"]), "\nbatch:", mixed["batch"])
    finally:
        server.stop()
    base, loaded = summary(alone), summary(mixed["ttfts"])
    result = {
        "benchmark": "batch_with_online",
        "machine": platform.processor() or platform.machine(),
        "cpu": cpu_model_name(),
        "cpu_isa": [name for name, present in isa_flags().items() if present],
        "model": "embedded default (SmolLM2-135M-Instruct)",
        "online": {"rate_per_s": args.rate, "max_tokens": ONLINE_MAX_TOKENS, "stream": True},
        "batch_max_tokens": BATCH_MAX_TOKENS,
        "server_args": server_args[2:],
        "online_alone": base,
        "online_with_batch": loaded,
        "ttft_p99_ratio": round(loaded["ttft_ms_p99"] / base["ttft_ms_p99"], 2),
        "ttft_p50_ratio": round(loaded["ttft_ms_p50"] / base["ttft_ms_p50"], 2),
        "target_p99_ratio": 1.2,
        "batch": mixed["batch"],
        "command": "python bench/scripts/batch_with_online.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
