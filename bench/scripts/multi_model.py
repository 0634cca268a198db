"""Several models behind one server, through the registry (issue 30): the embedded model registered twice
(smol@1, smol@2, alias smol-stable -> smol@1) in a fresh registry, a `tokenmill serve --registry` beside it,
and then:

- first-token latency of the first request to an unloaded model (verify + engine process + weights + the
  request), and of the next one (warm);
- cold load time through the admin API (POST /admin/models/load) and the server's model_load_seconds;
- alias switch time: moving an alias between two loaded versions, and moving it back with unload_previous
  (which drains the old version and waits for its engine process to exit);
- resident memory (RSS) of each loaded model's engine process, and of the server process.

Usage: .venv/bin/python bench/scripts/multi_model.py [--kv-cache-memory-gb 0.25] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tokenmill.loader.default_model import default_model_path
from tokenmill.registry import Registry

ADMIN_KEY = "bench-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def first_token_s(client: httpx.Client, model: str, max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first text chunk."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"text":' in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"no token came back from {model}")
    return first


def timed(call: Any) -> tuple[float, httpx.Response]:
    start = time.perf_counter()
    response = call()
    response.raise_for_status()
    return time.perf_counter() - start, response


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("the server exited before it was ready")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def measure(registry_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    model = default_model_path()
    registry = Registry(registry_dir)
    start = time.perf_counter()
    registry.add("smol", model)
    registry.add("smol", model, alias="smol-stable")
    registry.set_alias("smol-stable", "smol@1")
    add_s = (time.perf_counter() - start) / 2
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "serve", str(model), "--port", str(port)]
    command += ["--registry", str(registry_dir), "--admin-key", ADMIN_KEY, "--log-level", "warning"]
    command += ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server)
        with httpx.Client(base_url=url, timeout=600) as client:
            cold_ttft = first_token_s(client, "smol@1", args.max_tokens)
            warm_ttft = first_token_s(client, "smol@1", args.max_tokens)
            load_s, loaded = timed(lambda: client.post("/admin/models/load", json={"model": "smol@2"}, headers=ADMIN))
            switch_s, _ = timed(
                lambda: client.put("/admin/aliases/smol-stable", json={"model": "smol@2"}, headers=ADMIN)
            )
            models = client.get("/admin/models", headers=ADMIN).json()["data"]
            rss = {m["id"]: rss_mib(m["pid"]) for m in models if m["pid"] is not None}
            back = {"model": "smol@1", "unload_previous": True}
            rollback_s, _ = timed(lambda: client.put("/admin/aliases/smol-stable", json=back, headers=ADMIN))
            metrics = client.get("/metrics").text
        server_rss = rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    load_lines = [line for line in metrics.splitlines() if line.startswith("tokenmill:model_load_seconds_sum")]
    return {
        "model": str(model),
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "registry_add_s": round(add_s, 3),
        "first_request_unloaded_ttft_s": round(cold_ttft, 3),
        "warm_ttft_s": round(warm_ttft, 3),
        "admin_cold_load_s": round(load_s, 3),
        "admin_cold_load_server_s": loaded.json()["load_seconds"],
        "alias_switch_s": round(switch_s, 4),
        "alias_rollback_with_unload_s": round(rollback_s, 3),
        "engine_rss_mib": {k: round(v, 1) for k, v in rss.items()},
        "server_rss_mib": round(server_rss, 1),
        "model_load_seconds_sum": load_lines,
        "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenmill-registry-") as tmp:
        results = measure(Path(tmp), args)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
