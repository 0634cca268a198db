"""A C++ kernel that fails to build must fail the kernel tier: the kernel tests skip where an extension
is missing (the engine then runs its PyTorch ops), which would hide a broken build behind skips."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from tokenmill.ops import build, kernel_cache


def _toolchain_missing() -> str | None:
    """Why this machine cannot build the kernels at all, or None where it can."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) here: the kernels fall back to PyTorch ops"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed here: the kernels fall back to PyTorch ops"
    return None


def test_every_kernel_builds_where_a_toolchain_exists() -> None:
    missing = _toolchain_missing()
    if missing is not None:
        pytest.skip(missing)
    assert build.build_all() == [], f"these kernels failed to build for {build.cpu_isa()} (see the warnings above)"


def test_a_broken_build_is_reported_as_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path))  # an empty cache: the build must run

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("compiler error")

    monkeypatch.setattr(cpp_extension, "load", broken)
    assert build._build("cpu_ops", python_module=True) is None  # the engine's fallback path: no exception


def test_each_library_builds_in_a_process_of_its_own() -> None:
    # python -m tokenmill.ops.build gives each extension a process; the moe library must not need packed_gemm's ops.
    missing = _toolchain_missing()
    if missing is not None:
        pytest.skip(missing)
    code = "import sys; from tokenmill.ops import build; sys.exit(0 if build._build_one('moe') else 1)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
