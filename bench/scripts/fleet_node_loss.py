"""Losing a replica and then a whole Ray node under load (issue 47): every request completes or ends with a
clear error, none is silently lost.

Usage: .venv/bin/python bench/scripts/fleet_node_loss.py [--model MODEL] [--requests 32] [--concurrency 8]
           [--output bench/results/fleet_node_loss.json]

Builds a two-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head and one worker node, one
CPU each, so each node holds one replica), starts the fleet on it (`tokenmill serve --replicas 2`, its
ingress and HTTP proxy on the head: the worker joins once they are placed), then under load of streamed
completions:
  1. SIGKILLs one replica's Ray actor process; waits until both replicas serve again;
  2. removes the worker node (its raylet and every process on it killed, as when a machine dies); the fleet
     serves on with one replica; then adds a node back and waits until both replicas serve again.
Each request is classified as in fleet_kill.py: completed, error (an HTTP error or an error event) or
lost (the stream ended without either)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from fleet_common import ROOT, metric_sum, metrics, write_result
from fleet_kill import load, victim


def serving_again(url: str, timeout_s: float) -> float | None:
    """Seconds until the fleet has 2 running replicas and answers a request; None past `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            current = metric_sum(metrics(url), "tokenmill:fleet_replicas", state="current")
            ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            if current == 2 and ok.status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return None


def under_load(url: str, args: argparse.Namespace, fault: Any) -> dict[str, int]:
    """Run the load, call `fault()` `--fault-after` seconds in, and count the outcomes."""

    async def run() -> list[str]:
        task = asyncio.ensure_future(load(url, args.requests, args.concurrency, args.max_tokens))
        await asyncio.sleep(args.fault_after)
        await asyncio.to_thread(fault)
        return await task

    outcomes = asyncio.run(run())
    return {k: outcomes.count(k) for k in ("completed", "error", "lost")}


def start_fleet(model: list[str], port: int) -> Any:
    from tokenmill.fleet.flags import fleet_config, serve_parser
    from tokenmill.fleet.launcher import FleetRun
    from tokenmill.server.cli import engine_and_server_config
    from tokenmill.settings import parse_args

    parsed = parse_args(serve_parser(), [*model, "--replicas", "2", "--port", str(port)])
    engine_args, config = engine_and_server_config(parsed)
    return FleetRun(engine_args, config, fleet_config(parsed), log_to_driver=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", nargs="*", default=[], help="model argument(s) of tokenmill serve (default: embedded)"
    )
    parser.add_argument("--requests", type=int, default=32, help="per fault")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--fault-after", type=float, default=4.0, help="seconds into the load")
    parser.add_argument("--recover-timeout", type=float, default=180.0)
    parser.add_argument("--port", type=int, default=8943)
    parser.add_argument("--output", default="fleet_node_loss.json")
    args = parser.parse_args()

    from ray import serve
    from ray.cluster_utils import Cluster

    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    # One HTTP proxy, on the head: a proxy per node would bind the same port twice on one machine.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    # Deploy on a thread (serve.run waits for both replicas); the worker joins from here (Ray starts nodes
    # from the main thread only) once the ingress is placed on the head, the only node then.
    started = time.monotonic()
    runs: list[Any] = []
    deploying = threading.Thread(target=lambda: runs.append(start_fleet(args.model, args.port)), daemon=True)
    deploying.start()
    time.sleep(15.0)
    worker = cluster.add_node(num_cpus=1)
    deploying.join(args.recover_timeout)
    if not runs:
        cluster.shutdown()
        raise SystemExit("the fleet did not start; see the log above")
    run = runs[0]
    print(f"fleet up on 2 nodes after {time.monotonic() - started:.0f} s", flush=True)
    result: dict[str, Any] = {
        "command": shlex.join([".venv/bin/python", str(Path(sys.argv[0]).resolve().relative_to(ROOT)), *sys.argv[1:]]),
        "nodes": 2,
        "replicas": 2,
        "requests_per_fault": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
    }
    try:

        def kill_replica() -> None:
            pid = victim("replica")
            os.kill(pid, signal.SIGKILL)
            print(f"killed replica process {pid}", flush=True)

        result["replica_killed"] = under_load(url, args, kill_replica)
        result["replica_killed"]["fleet_back_after_s"] = serving_again(url, args.recover_timeout)

        def remove_worker() -> None:
            cluster.remove_node(worker, allow_graceful=False)
            print("removed the worker node", flush=True)

        result["node_removed"] = under_load(url, args, remove_worker)
        cluster.add_node(num_cpus=1)
        result["node_removed"]["fleet_back_after_node_added_s"] = serving_again(url, args.recover_timeout)
    finally:
        run.stop()  # undeploys and leaves Ray
        cluster.shutdown()
    print(result)
    write_result(args.output, result)
    lost = result["replica_killed"]["lost"] + result["node_removed"]["lost"]
    if lost:
        raise SystemExit(f"{lost} requests were silently lost")


if __name__ == "__main__":
    main()
