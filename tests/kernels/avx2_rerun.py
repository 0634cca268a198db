"""A kernel test file's AVX2 pass: the same file again in a subprocess under TOKENMILL_CPU_ISA=avx2
(the kernels built with -march=x86-64-v3), on a CPU with AVX-512 (where the native build takes other
paths) that can run that build."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.ops import build

REPO = Path(__file__).resolve().parents[2]


def avx2_rerun_test(test_file: str, select: str | None = None) -> Callable[[], None]:
    """A test that reruns `test_file` (all but this test, or the tests the -k expression `select`
    picks) under the AVX2 build; assign it to a `test_...` name in that file."""

    @pytest.mark.timeout(1800)  # builds the kernels for AVX2 on first use
    @pytest.mark.skipif(not build.cpu_has_avx2(), reason="this CPU cannot run code built for AVX2 (x86-64-v3)")
    @pytest.mark.skipif(build.cpu_isa() == "avx2", reason="this process is the AVX2 build already")
    @pytest.mark.skipif(
        not build.cpu_has_avx512(),
        reason="without AVX-512 the native build compiles the AVX2 build's code paths: this file ran on them",
    )
    def test_the_avx2_build_passes_these_tests() -> None:
        env = {**os.environ, build.ISA_ENV: "avx2"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            test_file,
            "-k",
            f"({select or 'not avx2_build'}) and not avx2_build",
        ]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
        assert proc.returncode == 0, f"under {build.ISA_ENV}=avx2:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
        assert " passed" in proc.stdout

    return test_the_avx2_build_passes_these_tests
