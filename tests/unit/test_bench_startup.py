"""bench/scripts/startup.py, issue 48's start-up benchmark: a start that never gets ready is recorded, not waited
on, and a figure is the median of the runs that succeeded."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "startup.py"
_spec = importlib.util.spec_from_file_location("startup_bench", SCRIPT)
assert _spec is not None and _spec.loader is not None
startup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(startup)


def test_a_server_that_never_answers_is_recorded_as_failed_with_its_phase_lines() -> None:
    # A "server" that prints a phase line and uvicorn's own, then hangs without listening (bash ignores --port P).
    script = 'echo "start-up: imports 1.2 s"; echo "INFO: Application startup complete."; sleep 60'
    start = time.monotonic()
    run = startup.serve_once(["bash", "-c", script, "bash"], None, timeout_s=1.0)
    assert time.monotonic() - start < 10
    assert "health_s" not in run and "within 1 s" in run["error"]
    assert run["phases"] == ["start-up: imports 1.2 s"]


def test_a_figure_is_the_median_of_the_runs_that_succeeded_beside_its_target() -> None:
    runs = [{"health_s": 4.0}, {"error": "exited with 1"}, {"health_s": 2.0}, {"health_s": 2.5}]
    summary = startup.summarize(runs, {"health_s": 3.0})
    assert summary["health_s"] == {"median": 2.5, "values": [4.0, 2.0, 2.5], "target_max": 3.0, "meets_target": True}
    assert summary["errors"] == [{"run": 1, "error": "exited with 1"}]
