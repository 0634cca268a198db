"""The live dashboard's cost: serving throughput with /dashboard open and refreshing against closed.

Usage: .venv/bin/python bench/scripts/dashboard_cost.py [--model MODEL] [--runs 3] [--viewers 1]
           [--num-prompts 64] [--workload random-cpu] [--port 8031] [--output bench/results/dashboard_cost.json]
           [--serve-args "--max-num-seqs 16"]

One `tokenmill serve` (the embedded model unless --model); then --runs pairs of `tokenmill bench serve
--request-rate inf`, alternating closed / open so drift hits both alike. "Open" is --viewers clients doing
what the page does: one full GET /dashboard/data, then one GET ?since=<last point> every second (the
browser's own rendering runs on the viewer's machine, not the server's). Reports the median total
tokens/s of each and their ratio (target: open >= 0.95x closed).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

TOKENMILL = shutil.which("tokenmill") or str(Path(sys.executable).with_name("tokenmill"))


class Viewer(threading.Thread):
    """Polls /dashboard/data as the page does until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.polls = url, threading.Event(), 0

    def run(self) -> None:
        since = 0.0
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.stop.is_set():
                points = client.get("/dashboard/data", params={"since": since}).json()["points"]
                since = points[-1]["t"] if points else since
                self.polls += 1
                self.stop.wait(1.0)


def bench(url: str, args: argparse.Namespace) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [TOKENMILL, "bench", "serve", "--base-url", url, "--workload", args.workload, "--request-rate", "inf"]
        cmd += ["--num-prompts", str(args.num_prompts), "--seed", "0", "--output-json", out.name]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return float(json.loads(Path(out.name).read_text())["results"][0]["total_token_throughput"])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not get ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--viewers", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--workload", default="random-cpu")
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--serve-args", default="")
    parser.add_argument("--output", type=Path, default=Path("bench/results/dashboard_cost.json"))
    args = parser.parse_args()

    url = f"http://127.0.0.1:{args.port}"
    cmd = [TOKENMILL, "serve", *([args.model] if args.model else []), "--port", str(args.port)]
    proc = subprocess.Popen(cmd + ["--log-level", "warning", *shlex.split(args.serve_args)], start_new_session=True)
    runs: dict[str, list[float]] = {"closed": [], "open": []}
    try:
        wait_ready(url, proc)
        bench(url, argparse.Namespace(**{**vars(args), "num_prompts": max(4, args.num_prompts // 8)}))  # warm-up
        for i in range(args.runs):
            runs["closed"].append(bench(url, args))
            viewers = [Viewer(url) for _ in range(args.viewers)]
            for v in viewers:
                v.start()
            runs["open"].append(bench(url, args))
            for v in viewers:
                v.stop.set()
                v.join()
            print(f"run {i + 1}: closed {runs['closed'][-1]:.1f} tok/s, open {runs['open'][-1]:.1f} tok/s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    closed, opened = statistics.median(runs["closed"]), statistics.median(runs["open"])
    result = {
        "command": " ".join(sys.argv),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "total_tokens_per_s": runs,
        "median_closed": closed,
        "median_open": opened,
        "ratio_open_to_closed": opened / closed if closed else None,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"median total tok/s: closed {closed:.1f}, open {opened:.1f}: {opened / closed:.3f}x -> {args.output}")


if __name__ == "__main__":
    main()
