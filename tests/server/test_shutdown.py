"""SIGTERM under load: requests that can finish within --shutdown-timeout do, the rest end with
finish_reason "abort", new requests get 503 meanwhile, and the process exits 0 within its bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import free_port, long_context_copy

SHUTDOWN_TIMEOUT_S = 3.0


def _stream(url: str, body: dict[str, Any], result: dict[str, Any]) -> None:
    finish = None
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                finish = choices[0].get("finish_reason") or finish
                result["tokens"] = result.get("tokens", 0) + 1
            elif line == "data: [DONE]":
                result["done"] = True
    result["finish_reason"] = finish


def test_sigterm_drains_then_aborts_then_exits(chat_model: Path, tmp_path: Path) -> None:
    # The long requests must outlast the drain on a fast machine: 16,000 tokens take several seconds.
    model = long_context_copy(chat_model, tmp_path / "model", positions=16384)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "serve",
        str(model),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "2048",
        "--max-num-seqs",
        "8",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        _wait_ready(url, proc)
        short = [{"prompt": [5, 6, 7], "max_tokens": 24, "ignore_eos": True, "stream": True} for _ in range(3)]
        long = [{"prompt": [8, 9], "max_tokens": 16000, "ignore_eos": True, "stream": True} for _ in range(2)]
        results: list[dict[str, Any]] = [{} for _ in short + long]
        threads = [threading.Thread(target=_stream, args=(url, b, r)) for b, r in zip(short + long, results)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        # All accepted and generating. A short request may already be done: a stream whose client reads
        # slower than the engine writes gets the pending tokens merged into one chunk.
        while not all(r.get("done") or r.get("tokens", 0) >= 2 for r in results):
            assert time.monotonic() < deadline, results
            time.sleep(0.01)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with httpx.Client(timeout=10) as client:
            refused = client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "shutting_down"
            assert client.get(f"{url}/ready").status_code == 503
        for t in threads:
            t.join(30)
        proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 15)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 0, output
    assert elapsed < SHUTDOWN_TIMEOUT_S + 10, elapsed
    assert [r["finish_reason"] for r in results[:3]] == ["length"] * 3
    assert [r["finish_reason"] for r in results[3:]] == ["abort"] * 2
    assert all(r.get("done") and r["status"] == 200 for r in results)


def _wait_ready(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")
