"""Helpers of the fleet_*.py benchmarks: start `tokenmill serve` (one server, or replicas on Ray Serve) as a
subprocess, wait for it, read its Prometheus metrics, run `tokenmill bench serve` against it, stop it, and
sample the CPU time of processes from /proc."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
CLK_TCK = os.sysconf("SC_CLK_TCK")


@contextmanager
def serving(args: list[str], port: int, log: Path, timeout_s: float = 600) -> Iterator[str]:
    """`tokenmill serve *args --port port` until the block ends (then SIGINT, as Ctrl-C)."""
    with log.open("w") as out:
        proc = subprocess.Popen([TOKENMILL, "serve", *args, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up in {timeout_s} s; see {log}")
            time.sleep(1)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def bench_serve(url: str, out_json: Path, *args: str) -> dict[str, Any]:
    """Run `tokenmill bench serve` against url; returns its (first) result: output_throughput,
    request_throughput, latency_ms {ttft, tpot, itl, e2el: {mean, median, p90, p99}}, ..."""
    cmd = [TOKENMILL, "bench", "serve", "--base-url", url, "--output-json", str(out_json), *args]
    subprocess.run(cmd, check=True)
    result: dict[str, Any] = json.loads(out_json.read_text())["results"][0]
    return result


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def processes(pattern: str) -> dict[int, str]:
    """pid -> command line of the processes whose command line matches `pattern`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if re.search(pattern, cmdline):
            found[int(entry.name)] = cmdline
    return found


def children(pid: int) -> list[int]:
    """The direct children of a process (of any of its threads: Ray runs user code on its own thread)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def write_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / Path(name).name  # a name, or a path whose file name is kept
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
