"""File operations the registry's promises rest on: hashing, hard link or copy, atomic JSON, one writer."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tokenmill.registry.errors import RegistryBusyError

_CHUNK = 1 << 20
_LOCK_POLL_S = 0.05


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class HashCache:
    """sha256 digests by file identity (device, inode, mtime, size): a file none of these changed for is not
    read again. Rewriting a file in place changes its mtime; replacing it changes its inode."""

    def __init__(self) -> None:
        self._digests: dict[tuple[int, int, int, int], str] = {}
        self._lock = threading.Lock()  # loads verify on worker threads

    def sha256(self, path: Path) -> str:
        before = _identity(path)
        with self._lock:
            known = self._digests.get(before)
        if known is not None:
            return known
        digest = sha256_of(path)
        if _identity(path) == before:  # not written to while being read
            with self._lock:
                self._digests[before] = digest
        return digest


def link_or_copy(src: Path, dst: Path, copy: bool = False) -> None:
    """Hard-link src to dst (no extra disk, instant), else copy it: another filesystem, or links refused.

    A hard link shares the file with the source, so rewriting the source in place changes the registry's
    copy too; `verify` catches that, and `copy=True` avoids it.
    """
    src = src.resolve()  # a symlink (an HF hub snapshot) stands for its target
    if not copy:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass  # EXDEV (another filesystem), EPERM (protected_hardlinks), a filesystem without links
    shutil.copyfile(src, dst)


def write_json_atomic(path: Path, data: Any) -> None:
    """Readers see the old file or the new one, never half of it: write a temp file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def exclusive_lock(path: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing): one writer at a time, across processes.
    RegistryBusyError if another writer holds it past `timeout_s` (None: wait as long as it takes).

    The kernel drops the lock when its holder dies, so a crashed writer never blocks the next one.
    """
    with path.open("a") as f:
        if timeout_s is None:
            fcntl.flock(f, fcntl.LOCK_EX)
        else:
            _flock_within(f.fileno(), timeout_s, path)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _flock_within(fd: int, timeout_s: float, path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not try_flock(fd):
        if time.monotonic() >= deadline:
            raise RegistryBusyError(
                f"another writer has held the registry lock {path} for over {timeout_s:g} s "
                "(a `tokenmill models add` of a large model, say); retry once it is done"
            )
        time.sleep(_LOCK_POLL_S)


def try_flock(fd: int) -> bool:
    """Take an exclusive flock on `fd` without waiting; False if another holder has it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
