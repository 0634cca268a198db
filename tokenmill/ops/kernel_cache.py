"""Where the compiled kernels live, and the one way into that cache: import a finished build, or compile it
under its build lock.

    <root>/<isa>-<key>/<extension>/<extension>.so

The root is TOKENMILL_KERNEL_CACHE, else ~/.cache/tokenmill/kernels.
The key is a digest of every source and header, the compiler flags and torch's and Python's versions: a
changed source gets a folder of its own, so it never reuses, nor fights over, an older build. A folder's
library appears by an atomic rename once its build is complete, so a library that is there is loaded as it
is: no compiler, no ninja, no lock."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from types import ModuleType

from tokenmill.ops.build_lock import build_lock

CACHE_ENV = "TOKENMILL_KERNEL_CACHE"
SCRATCH_PREFIX = "tmp-"  # <extension folder>/tmp-<pid>: one build's objects, renamed from when complete


def cache_root() -> Path:
    """The kernel cache's root folder: TOKENMILL_KERNEL_CACHE, else ~/.cache/tokenmill/kernels. Not under
    $TOKENMILL_CACHE: tests point that at empty folders, and each would rebuild every kernel (minutes)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "tokenmill" / "kernels"


def cache_folder(isa: str, csrc: Path, flags: list[str]) -> Path:
    """The folder of every extension built from the sources in `csrc` with `flags` for `isa`."""
    digest = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        if path.suffix in (".h", ".cpp"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    # torch's version from its metadata: `tokenmill info` asks without importing torch
    digest.update(json.dumps([flags, metadata.version("torch"), sys.version_info[:2]]).encode())
    return cache_root() / f"{isa}-{digest.hexdigest()[:16]}"


def library(folder: Path, ext: str) -> Path:
    """The finished library of extension `ext` in a cache folder (it exists once the build is complete)."""
    return folder / ext / f"{ext}.so"


def load(
    ext: str, sources: list[Path], folder: Path, cflags: list[str], include: Path, python_module: bool
) -> ModuleType | str:
    """Extension `ext` loaded from `folder` (a pybind module, or the path of a torch-op library), compiled
    first where it is not there; raises where it cannot be built."""
    lib = library(folder, ext)
    if not lib.exists():
        with build_lock(lib.parent):
            if not lib.exists():  # else another process built it while this one waited
                return _compile(ext, sources, lib, cflags, include, python_module)
    if python_module:
        spec = importlib.util.spec_from_file_location(ext, lib)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the kernel library {lib}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    import torch

    torch.ops.load_library(str(lib))
    return str(lib)


def _compile(
    ext: str, sources: list[Path], lib: Path, cflags: list[str], include: Path, python_module: bool
) -> ModuleType | str:
    """Build (and load) `ext` in a scratch folder of this process, then publish its library at `lib`. The
    caller holds the build lock, so any other scratch folder was left by a build that died: removed."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    for stale in lib.parent.glob(f"{SCRATCH_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    scratch = lib.parent / f"{SCRATCH_PREFIX}{os.getpid()}"
    scratch.mkdir()
    loaded = cpp_extension.load(
        name=ext,
        sources=[str(s) for s in sources],
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(include)],
        build_directory=str(scratch),
        is_python_module=python_module,  # False: registers torch ops, no pybind11
        verbose=False,
    )
    os.replace(scratch / lib.name, lib)
    shutil.rmtree(scratch, ignore_errors=True)
    return loaded if python_module else str(lib)


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the one pip installs sits beside this Python, off PATH where a venv's
    python runs without the venv activated."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts) is not None:
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
