"""2 replicas x 1 core against 1 engine x 2 cores, through the server, same load (issue 28), and the CPU
that Ray's own processes take while idle.

Usage: .venv/bin/python bench/scripts/fleet_scaling.py [--model MODEL] [--workload random-cpu]
           [--request-rate inf] [--idle-seconds 20] [--repeats 3] [--output bench/results/fleet_scaling.json]

- one: `tokenmill serve MODEL` (one engine using every core: torch's default threads);
- fleet: `tokenmill serve MODEL --replicas 2 --cpus-per-replica 1` (each replica's engine on 1 thread).
Both get `tokenmill bench serve --workload W` after one warm-up request, `--repeats` times, the two
alternating so that a noisy machine's drift hits both; medians are quoted. Before the fleet's load, the
script samples for `--idle-seconds` the CPU time of Ray's processes (raylet, gcs_server, the dashboard
agents, the Serve controller and proxy, the ingress, and the replicas with their engines): the cost of
the fleet when it does nothing, as a share of one core."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fleet_common import bench_serve, children, cpu_seconds, processes, serving, write_result

RAY_PROCESSES = {
    "raylet": r"/raylet ",
    "gcs_server": r"gcs_server",
    "dashboard_and_agents": r"dashboard|RuntimeEnvAgent|DashboardAgent|log_monitor|monitor\.py",
    "serve_controller": r"ServeController",
    "serve_proxy": r"ProxyActor",
    "ingress": r"ServeReplica:tokenmill:TokenmillIngress",
    "replicas": r"ServeReplica:tokenmill:TokenmillReplica",
    "idle_workers": r"ray::IDLE|default_worker\.py",
}


def idle_cpu(seconds: float) -> dict[str, float]:
    """Share of one core each group of Ray processes used over `seconds` of no requests."""
    groups = {name: list(processes(pattern)) for name, pattern in RAY_PROCESSES.items()}
    # The replicas' engine processes: their spawned children (other users' processes stay out).
    groups["replica_engines"] = [c for p in groups["replicas"] for c in children(p)]
    before = {name: sum(cpu_seconds(p) for p in pids) for name, pids in groups.items()}
    time.sleep(seconds)
    shares = {name: (sum(cpu_seconds(p) for p in pids) - before[name]) / seconds for name, pids in groups.items()}
    shares["total"] = sum(shares.values())
    return {k: round(v, 4) for k, v in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", nargs="*", default=[], help="model argument(s) of tokenmill serve (default: embedded)"
    )
    parser.add_argument("--serve-args", default="", help="more tokenmill serve flags for both")
    parser.add_argument("--workload", default="random-cpu")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=8944)
    parser.add_argument("--output", default="fleet_scaling.json")
    args = parser.parse_args()
    load = ["--workload", args.workload, "--request-rate", args.request_rate, "--seed", "0", "--warmup-requests", "1"]
    if args.num_prompts:
        load += ["--num-prompts", str(args.num_prompts)]
    configs = {"one_engine_2_cores": [], "two_replicas_1_core": ["--replicas", "2", "--cpus-per-replica", "1"]}
    result: dict[str, Any] = {"workload": args.workload, "runs": {name: [] for name in configs}}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, extra in configs.items():
                serve_args = [*args.model, *args.serve_args.split(), *extra]
                with serving(serve_args, args.port, Path(tmp) / f"{name}.log") as url:
                    if extra and repeat == 0:
                        result["ray_idle_cpu_share_of_one_core"] = idle_cpu(args.idle_seconds)
                    run = bench_serve(url, Path(tmp) / f"{name}.json", *load)
                result["runs"][name].append(
                    {
                        "output_throughput": run["output_throughput"],
                        "request_throughput": run["request_throughput"],
                        "total_token_throughput": run["total_token_throughput"],
                        "latency_ms": run["latency_ms"],
                        "failed": run["failed"],
                    }
                )
                print(f"{name} (run {repeat + 1}): {run['output_throughput']:.1f} output tok/s")
    result["median_output_throughput"] = {
        name: statistics.median(r["output_throughput"] for r in runs) for name, runs in result["runs"].items()
    }
    one, two = (result["median_output_throughput"][k] for k in configs)
    result["fleet_over_one_engine"] = round(two / one, 3) if one else None
    print(f"2 x 1 core / 1 x 2 cores: {result['fleet_over_one_engine']}")
    print(f"Ray idle (share of one core): {result.get('ray_idle_cpu_share_of_one_core')}")
    write_result(Path(args.output).name, result)


if __name__ == "__main__":
    main()
