"""Killing a replica under load (issue 28): every request completes or ends with a clear error, none is
silently lost, and the replica comes back.

Usage: .venv/bin/python bench/scripts/fleet_kill.py [--model MODEL] [--kill engine|replica] [--requests 48]
           [--concurrency 8] [--output bench/results/fleet_kill.json]

Starts `tokenmill serve MODEL --replicas 2`, sends `--requests` streamed completions (`--concurrency` at a
time), and a few seconds in SIGKILLs either one replica's engine process (`engine`: the replica restarts
its engine itself; requests with no output yet run again on the new one) or the replica's whole Ray actor
process (`replica`: Ray Serve replaces it; the ingress sends requests that got nothing yet to the other
replica). Each request is classified: completed (finish_reason set and [DONE]), error (an HTTP error status
or an error event in the stream), or lost (the stream ended without either). Then it waits until both
replicas serve again (the fleet's tokenmill:fleet_replicas{state="current"} back at 2 and a request
answered)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from fleet_common import children, metric_sum, metrics, processes, serving, write_result

PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 4


async def one_request(client: httpx.AsyncClient, url: str, max_tokens: int) -> str:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return "error"
            finished = done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error"
                finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
            return "completed" if finished and done else "lost"
    except httpx.HTTPError:
        return "error"  # the connection failed: the client knows


async def load(url: str, n: int, concurrency: int, max_tokens: int) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def bounded() -> str:
            async with gate:
                return await one_request(client, url, max_tokens)

        return await asyncio.gather(*(bounded() for _ in range(n)))


def victim(kind: str) -> int:
    replicas = sorted(processes(r"ServeReplica:tokenmill:TokenmillReplica"))
    if not replicas:
        raise RuntimeError("no replica process found")
    if kind == "replica":
        return replicas[0]
    # The engine core runs in a spawned multiprocessing child (not the resource tracker).
    spawned = processes("spawn_main")
    engines = [c for c in children(replicas[0]) if c in spawned]
    if not engines:
        raise RuntimeError("the replica has no engine process (--engine-in-thread?)")
    return engines[-1]


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    task = asyncio.ensure_future(load(url, args.requests, args.concurrency, args.max_tokens))
    await asyncio.sleep(args.kill_after)
    pid = victim(args.kill)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    print(f"killed {args.kill} process {pid}")
    outcomes = await task
    back_s = None
    deadline = time.monotonic() + args.recover_timeout
    while time.monotonic() < deadline:
        try:
            current = metric_sum(metrics(url), "tokenmill:fleet_replicas", state="current")
            ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            if current == 2 and ok.status_code == 200:
                back_s = time.monotonic() - killed_at
                break
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1)
    counts = {k: outcomes.count(k) for k in ("completed", "error", "lost")}
    return {"kill": args.kill, "requests": args.requests, **counts, "fleet_back_after_s": back_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", nargs="*", default=[], help="model argument(s) of tokenmill serve (default: embedded)"
    )
    parser.add_argument("--kill", choices=("engine", "replica"), default="engine")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kill-after", type=float, default=5.0, help="seconds into the load")
    parser.add_argument("--recover-timeout", type=float, default=180.0)
    parser.add_argument("--port", type=int, default=8942)
    parser.add_argument("--output", default=None, help="default: fleet_kill_<kill>.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        with serving([*args.model, "--replicas", "2"], args.port, log) as url:
            result = asyncio.run(run(url, args))
    print(result)
    write_result(args.output or f"fleet_kill_{args.kill}.json", result)
    if result["lost"]:
        raise SystemExit(f"{result['lost']} requests were silently lost")


if __name__ == "__main__":
    main()
