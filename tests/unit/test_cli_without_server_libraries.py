"""The CLI without the server's libraries (a GPU image with its own stack, say): every command but
`serve` works, and `serve` says what is missing. Run in a subprocess, so the blocked import stays there."""

from __future__ import annotations

import subprocess
import sys

BLOCK_FASTAPI = "import sys; sys.modules['fastapi'] = None; from tokenmill.cli import main; main(sys.argv[1:])"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_FASTAPI, *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_bench_runs_without_fastapi() -> None:
    proc = run_cli("bench", "throughput", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--workload" in proc.stdout


def test_serve_without_fastapi_says_what_is_missing() -> None:
    proc = run_cli("serve")
    assert proc.returncode == 2
    assert "tokenmill serve needs the server's libraries" in proc.stderr and "fastapi" in proc.stderr
