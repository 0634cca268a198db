"""A kernel build that is interrupted never blocks a later start: the build lock is an flock, released by the
OS when its owner dies, so the next process takes it over at once (torch's own lock file would make it wait
forever). Checked on a tiny library through a compiler that dawdles, in a cache folder of the test's own."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tokenmill.ops import kernel_cache
from tokenmill.ops.build_lock import build_lock

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}

_HOLD = """
import sys, time
from pathlib import Path
from tokenmill.ops.build_lock import build_lock
with build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(folder: Path) -> subprocess.Popen[str]:
    """A process that holds `folder`'s build lock until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.timeout(60)
def test_a_live_owner_is_waited_on_and_a_dead_one_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = _holder(tmp_path)
    acquired = threading.Event()

    def take() -> None:
        with build_lock(tmp_path):
            acquired.set()

    with caplog.at_level(logging.WARNING, logger="tokenmill.ops.build_lock"):
        waiter = threading.Thread(target=take)
        waiter.start()
        assert not acquired.wait(1.0), "took the lock of a live build"
        assert f"waiting for the kernel build of pid {holder.pid}" in caplog.text
        holder.kill()  # SIGKILL: no clean-up of its own
        holder.wait()
        assert acquired.wait(10.0), "a dead build's lock was not taken over"
        waiter.join()


@pytest.mark.timeout(60)
def test_a_lock_left_by_a_killed_build_is_taken_at_once(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    holder.kill()
    holder.wait()
    assert (tmp_path / "build.lock").read_text().strip() == str(holder.pid)  # its file and pid are still there
    started = time.monotonic()
    with build_lock(tmp_path):
        assert (tmp_path / "build.lock").read_text().strip() == str(os.getpid())
    assert time.monotonic() - started < 1.0


# A compiler that waits (while the file $SLOW exists) before it compiles, so a build can be killed mid-way.
_SLOW_CXX = """#!/bin/sh
case " $* " in *" -c "*) if [ -e "$SLOW" ]; then touch "$STARTED"; sleep 300; fi;; esac
exec {cxx} "$@"
"""
_BUILD = """
import sys
from pathlib import Path
from tokenmill.ops import kernel_cache
src, folder = Path(sys.argv[1]), Path(sys.argv[2])
print(kernel_cache.load("tm_lock_test", [src], folder, ["-O0"], src.parent, python_module=False))
"""


@pytest.mark.timeout(240)
def test_a_build_killed_mid_way_does_not_block_the_next(tmp_path: Path) -> None:
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "c++").write_text(_SLOW_CXX.format(cxx=cxx))
    (bin_dir / "c++").chmod(0o755)
    src = tmp_path / "tiny.cpp"
    src.write_text('extern "C" int tm_lock_test() { return 1; }\n')
    slow, started = tmp_path / "slow", tmp_path / "started"
    slow.touch()
    env = {**ENV, "CXX": str(bin_dir / "c++"), "SLOW": str(slow), "STARTED": str(started)}
    folder = tmp_path / "cache"
    cmd = [sys.executable, "-c", _BUILD, str(src), str(folder)]

    first = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():  # its compiler runs, under its lock
            assert first.poll() is None and time.monotonic() < deadline, "the first build never reached the compiler"
            time.sleep(0.1)
        first.kill()  # the build process only: its ninja and compiler live on, as when a server is stopped
        first.wait()
        slow.unlink()
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)  # the orphaned ninja and compiler
    assert second.returncode == 0, second.stderr
    lib = kernel_cache.library(folder, "tm_lock_test")
    assert second.stdout.strip() == str(lib) and lib.exists()
    assert sorted(p.name for p in lib.parent.iterdir()) == sorted([lib.name, "build.lock"])  # no scratch left
