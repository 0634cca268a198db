"""An autoscaling trace under a step load (issue 28): replicas and queue depth over time, as JSON and a PNG.

Usage: .venv/bin/python bench/scripts/fleet_autoscale.py [--model MODEL] [--autoscale 1:2]
           [--target-ongoing-requests 2] [--steps 20:1,60:12,60:1] [--output bench/results/fleet_autoscale]

Starts `tokenmill serve MODEL --autoscale MIN:MAX --target-ongoing-requests K`, then runs a closed-loop
load whose number of concurrent clients steps as `--steps` says (seconds:clients, ...), each client sending
streamed completions back to back. Every second it reads the fleet's /metrics: tokenmill:fleet_replicas
{state=current|target}, and the replicas' tokenmill:num_requests_waiting and num_requests_running summed.
Ray Serve scales up after `upscale_delay_s` (2 s) of demand above target and down after
`downscale_delay_s` (30 s) below it."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from fleet_common import RESULTS, metric_sum, serving, write_result

PROMPT = "Tell me about the history of the printing press in a few paragraphs. "


async def client_loop(client: httpx.AsyncClient, url: str, stop: asyncio.Event, max_tokens: int) -> int:
    done = 0
    while not stop.is_set():
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
        try:
            response = await client.post(f"{url}/v1/completions", json=body)
            done += response.status_code == 200
        except httpx.HTTPError:
            await asyncio.sleep(0.5)
    return done


async def sampler(url: str, start: float, stop: asyncio.Event, trace: list[dict[str, Any]], clients: list[int]) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            try:
                text = (await client.get(f"{url}/metrics")).text
            except httpx.HTTPError:
                text = ""
            trace.append(
                {
                    "t": round(time.monotonic() - start, 2),
                    "clients": clients[0],
                    "replicas_current": metric_sum(text, "tokenmill:fleet_replicas", state="current"),
                    "replicas_target": metric_sum(text, "tokenmill:fleet_replicas", state="target"),
                    "waiting": metric_sum(text, "tokenmill:num_requests_waiting"),
                    "running": metric_sum(text, "tokenmill:num_requests_running"),
                }
            )
            await asyncio.sleep(1.0)


async def step_load(url: str, steps: list[tuple[float, int]], max_tokens: int) -> list[dict[str, Any]]:
    trace: list[dict[str, Any]] = []
    clients = [0]
    start = time.monotonic()
    done = asyncio.Event()
    sampling = asyncio.ensure_future(sampler(url, start, done, trace, clients))
    tasks: list[asyncio.Future[int]] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for seconds, n in steps:
            stop = asyncio.Event()
            clients[0] = n
            tasks += [asyncio.ensure_future(client_loop(client, url, stop, max_tokens)) for _ in range(n)]
            await asyncio.sleep(seconds)
            stop.set()  # requests under way finish during the next step
        await asyncio.gather(*tasks)
    done.set()
    await sampling
    return trace


def plot(trace: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p["t"] for p in trace]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    top.step(t, [p["replicas_current"] for p in trace], where="post", label="replicas running")
    top.step(t, [p["replicas_target"] for p in trace], where="post", linestyle="--", label="replicas target")
    top.set_ylabel("replicas")
    top.legend(loc="upper left")
    top.set_title(title)
    bottom.plot(t, [p["waiting"] for p in trace], label="requests waiting (all replicas)")
    bottom.plot(t, [p["running"] for p in trace], label="requests running (all replicas)")
    bottom.step(t, [p["clients"] for p in trace], where="post", color="grey", alpha=0.5, label="clients (load)")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("requests")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", nargs="*", default=[], help="model argument(s) of tokenmill serve (default: embedded)"
    )
    parser.add_argument("--autoscale", default="1:2")
    parser.add_argument("--target-ongoing-requests", default="2")
    parser.add_argument("--steps", default="20:1,60:12,60:1", help="seconds:clients, ...")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8943)
    parser.add_argument("--output", default="fleet_autoscale", help="name of the .json and .png in bench/results")
    args = parser.parse_args()
    steps = [(float(s.split(":")[0]), int(s.split(":")[1])) for s in args.steps.split(",")]
    serve_args = [*args.model, "--autoscale", args.autoscale, "--target-ongoing-requests", args.target_ongoing_requests]
    with tempfile.TemporaryDirectory() as tmp, serving(serve_args, args.port, Path(tmp) / "serve.log") as url:
        trace = asyncio.run(step_load(url, steps, args.max_tokens))
    name = Path(args.output).name
    write_result(f"{name}.json", {"autoscale": args.autoscale, "steps": steps, "trace": trace})
    title = f"--autoscale {args.autoscale} --target-ongoing-requests {args.target_ongoing_requests}"
    plot(trace, RESULTS / f"{name}.png", title)


if __name__ == "__main__":
    main()
