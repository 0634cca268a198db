"""File operations the registry's promises rest on: hashing, hard link or copy, atomic JSON, one writer."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing): one writer at a time, across processes.

    The kernel drops the lock when its holder dies, so a crashed writer never blocks the next one.
    """
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
