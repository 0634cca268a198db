"""The Triton kernels not yet run on a GPU compile for an H100/H200 (sm_90) with triton's own compiler and
ptxas, no GPU needed (tests/kernels/gpu_compile.py, in a process of its own: it imports triton without the
interpreter the other Triton test files run under)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: `pip install -e '.[gpu]'`", allow_module_level=True)
PTXAS = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin" / "ptxas"  # type: ignore[union-attr, arg-type]


@pytest.mark.skipif(not PTXAS.exists(), reason=f"triton's ptxas is not at {PTXAS}: no cubin can be built here")
@pytest.mark.timeout(300)
def test_the_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.gpu_compile"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    compiled = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("compiled ")]
    assert compiled == [
        "rms_norm",
        "add_rms_norm",
        "qk_norm_rope",
        "rope",
        "silu_mul",
        "race_logits",
        "race_probs",
        "nucleus",
    ]
