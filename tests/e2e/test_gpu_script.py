"""bench/scripts/gpu.sh runs only on a lent GPU, minutes at a time: its plumbing is checked here on the CPU
(GPU_SH_SMOKE=1: the same steps, tiny, with the embedded model's shape), so that a loan is not spent on a
script that broke since the last one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = ["random_gpu", "hf_slice", "roofline", "profile"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gpu_script_runs_its_steps_in_smoke_mode(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_SH_SMOKE": "1", "PYTHON": sys.executable, "GPU_SH_BUDGET_S": "500"}
    proc = subprocess.run(
        ["bash", "bench/scripts/gpu.sh", str(tmp_path), *STEPS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()[1:]]
    assert [(name, rc) for name, rc, _ in rows] == [(name, "0") for name in STEPS], proc.stdout[-3000:]
    assert json.loads((tmp_path / "random_gpu.json").read_text())["results"]["output_tok_s"] > 0
    assert json.loads((tmp_path / "hf_slice.json").read_text())["output_tok_s"] > 0
    roofline = json.loads((tmp_path / "roofline.json").read_text())
    assert [run["result"] for run in roofline["runs"]] == ["random_gpu.json"]  # the only result of those it names
    assert roofline["runs"][0]["fraction_of_decode_ceiling"] > 0
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert profile["steps_measured"] == 3 and profile["step_ms"] > 0
