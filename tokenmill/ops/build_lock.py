"""The lock around one kernel build: an flock on a file in the extension's folder, with its owner's pid
written in it. The OS releases an flock when its owner dies (killed, Ctrl-C, out of memory), so a build
that was interrupted never blocks a later one: the next process takes the lock over at once, instead of
waiting forever on a lock file nobody will remove (torch's own build baton)."""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = "build.lock"


@contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Hold `folder`'s build lock while the block runs; wait (saying for whom) while a live process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the compiler (PEP 446)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for the kernel build of pid %s (%s)", _owner(fd), folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _owner(fd: int) -> str:
    """The pid the lock's holder wrote, or "?" before it has written one."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
