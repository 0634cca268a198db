"""The one build loader for our C++ CPU kernels: built ahead of time by `python -m tokenmill.ops.build`
(scripts/setup.sh runs it), else compiled on first use, and cached by instruction set and source digest
(tokenmill/ops/kernel_cache.py: TOKENMILL_KERNEL_CACHE, ~/.cache/tokenmill/kernels by default).

Every source and header lives in tokenmill/ops/csrc/; each extension is one .cpp file there:

    paged_decode: decode attention over the paged KV cache (pybind module, `load`)
    cpu_ops:      fused add+RMSNorm, SiLU-and-mul, in-place rotary, sampling (pybind module, `load`)
    decode_stack: every decoder layer of a decode step in one call (pybind module, `load`)
    packed_gemm:  the GEMM over packed int8 / bf16 / grouped weights, registered as torch.ops.tokenmill_quant.*
                  (no pybind11, `load_ops`)
    moe:          every expert of a mixture-of-experts layer in one call, torch.ops.tokenmill_moe.experts
                  (`load_ops`)

The kernels themselves are headers (ops/csrc/*.h), shared by these modules.

`python -m tokenmill.ops.build` builds the five for TOKENMILL_CPU_ISA ahead of time, in parallel processes
(scripts/setup.sh runs it; scripts/test.sh runs the AVX2 build while the linters run).

The instruction set: TOKENMILL_CPU_ISA=native (the default) compiles with -march=native, so the
kernels pick their AVX-512 BF16 / VNNI paths where this CPU has them; TOKENMILL_CPU_ISA=avx2 compiles
with -march=x86-64-v3 (AVX2 and FMA, no AVX-512), the path of CPUs without AVX-512, under other
extension names (suffix _avx2) so both builds stay cached side by side. The C++ picks its paths at
compile time (#ifdef __AVX512BF16__ and friends), so the flag alone decides which one runs; Python
code that asks whether bf16 dot products are there asks `cpu_has_avx512_bf16`, which honours it."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import ModuleType

from tokenmill.ops import kernel_cache

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = {name: CSRC / f"{name}.cpp" for name in ("paged_decode", "cpu_ops", "decode_stack", "packed_gemm", "moe")}
TORCH_OP_LIBRARIES = ("packed_gemm", "moe")  # loaded with load_ops; the others are pybind modules (load)
LONGEST_BUILD = "decode_stack"  # every kernel in one translation unit: over a minute on one core
ISA_ENV = "TOKENMILL_CPU_ISA"
# TOKENMILL_CPU_ISA value -> the -march flag. x86-64-v3: AVX2, FMA, F16C, BMI2 (Haswell and later).
MARCH = {"native": "-march=native", "avx2": "-march=x86-64-v3"}
# The same flags for every module, so a kernel compiled into two of them rounds the same in both.
# -fopenmp: at::parallel_for runs serially in code compiled without it.
CFLAGS = [
    "-O3",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]


@functools.cache
def cpu_isa() -> str:
    """The instruction set the kernels are built for in this process: "native" or "avx2"
    (TOKENMILL_CPU_ISA, read once)."""
    isa = (os.environ.get(ISA_ENV) or "native").strip().lower()
    if isa not in MARCH:
        raise ValueError(f"{ISA_ENV}={isa!r}: use one of {sorted(MARCH)}")
    return isa


def cflags(isa: str | None = None) -> list[str]:
    """The compiler flags of every extension: CFLAGS and the -march of `isa` (default `cpu_isa()`)."""
    return [*CFLAGS, MARCH[isa or cpu_isa()]]


def extension_name(name: str, isa: str | None = None) -> str:
    """The cached extension's name: tokenmill_<name>, with _avx2 appended for the AVX2 build."""
    isa = isa or cpu_isa()
    return f"tokenmill_{name}" if isa == "native" else f"tokenmill_{name}_{isa}"


def kernel_folder(isa: str | None = None) -> Path:
    """The cache folder of the extensions built from today's sources for `isa` (default `cpu_isa()`)."""
    return kernel_cache.cache_folder(isa or cpu_isa(), CSRC, cflags(isa))


def is_built(name: str, isa: str | None = None) -> bool:
    """Whether extension `name` is built for `isa` (default `cpu_isa()`), loadable without a compiler."""
    return kernel_cache.library(kernel_folder(isa), extension_name(name, isa)).exists()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(word for line in text.splitlines() if line.startswith("flags") for word in line.split())


def cpu_has_avx2() -> bool:
    """True where the CPU runs AVX2 and FMA (what TOKENMILL_CPU_ISA=avx2 compiles for)."""
    return {"avx2", "fma"} <= _cpu_flags()


def cpu_has_avx512() -> bool:
    """True where the CPU has AVX-512F: only then does the native build compile other code paths than the
    AVX2 build (every special path in csrc/ needs AVX-512 or AMX)."""
    return "avx512f" in _cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    """True where the CPU has AVX-512 BF16 dot products (or AMX bf16) and the kernels are built to use
    them: False under TOKENMILL_CPU_ISA=avx2, whatever the CPU. Where it is False bf16 arithmetic
    is slow on the CPU, so float32 (with bf16 weights widened in registers) is the faster path."""
    if cpu_isa() != "native":
        return False
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


AMX_ENV = "TOKENMILL_AMX"
AMX_SETTINGS = ("auto", "off")


@functools.cache
def amx_setting() -> str:
    """TOKENMILL_AMX, read once: "auto" (the default: bf16 layers on AMX tiles where the CPU has them) or
    "off" (the AVX-512 dot products, to compare against)."""
    setting = (os.environ.get(AMX_ENV) or "auto").strip().lower()
    if setting not in AMX_SETTINGS:
        raise ValueError(f"{AMX_ENV}={setting!r}: use one of {list(AMX_SETTINGS)}")
    return setting


def cpu_has_amx() -> bool:
    """True where bf16 layers should run on AMX tiles: the CPU has AMX-BF16 (amx_tile, amx_bf16), the
    kernels are built for it (TOKENMILL_CPU_ISA=native compiles them in) and TOKENMILL_AMX is not "off".
    Whether the kernel granted the tile state is packed_gemm.amx()'s to say."""
    return cpu_isa() == "native" and amx_setting() != "off" and {"amx_tile", "amx_bf16"} <= _cpu_flags()


# Each library keeps its own copy of the AMX switch (csrc/amx_tiles.h): set_amx sets every loaded one.
_amx: dict[str, bool] = {"on": True}
_loaded: dict[str, ModuleType | None] = {}  # library name -> its pybind module (None: a torch-op library)


def set_amx(on: bool) -> bool:
    """The AMX kernels on (where cpu_has_amx() and the Linux kernel grants the tile state) or off, in
    every library loaded now or later. Both paths read the same packed weights and cache, so this may
    flip between steps (to measure one against the other). Returns whether they run."""
    _amx["on"] = on
    answers = [_apply_amx(module) for module in _loaded.values()]
    return bool(answers) and all(answers)


def _apply_amx(module: ModuleType | None) -> bool:
    """A library's switch set to the process's; its answer (False where it has no AMX kernels)."""
    wanted = _amx["on"] and cpu_has_amx()
    if module is None:  # the packed GEMM's torch ops
        import torch

        return bool(torch.ops.tokenmill_quant.packed_gemm_set_amx(wanted))
    return bool(hasattr(module, "set_amx") and module.set_amx(wanted))


@functools.cache
def load(name: str) -> ModuleType | None:
    """The compiled pybind module `name` (a key of SOURCES), or None (with a warning) where it cannot
    be built (no compiler, no ninja): callers then use their pure-PyTorch path."""
    module = _build(name, python_module=True)
    if not isinstance(module, ModuleType):
        return None
    _loaded[name] = module
    _apply_amx(module)
    return module


@functools.cache
def load_ops(name: str) -> bool:
    """Build and load the torch-op library `name` (its ops register under torch.ops); False (with a
    warning) where it cannot be built."""
    if _build(name, python_module=False) is None:
        return False
    _loaded[name] = None
    _apply_amx(None)
    return True


def _build(name: str, python_module: bool) -> object:
    """The loaded extension (a module, or the library's path for torch-op libraries); None where the
    build failed."""
    ext = extension_name(name)
    try:
        return kernel_cache.load(ext, [SOURCES[name]], kernel_folder(), cflags(), CSRC, python_module)
    except Exception as exc:  # noqa: BLE001 (no compiler, no ninja: fall back, never fail the load)
        logger.warning("could not build the C++ kernel %r (%s); using PyTorch ops instead", ext, exc)
        return None


def build_all() -> list[str]:
    """Build (or find cached) and load every extension for this process's instruction set; the names that
    failed."""
    return [name for name in SOURCES if not (load_ops(name) if name in TORCH_OP_LIBRARIES else load(name) is not None)]


def _build_one(name: str) -> bool:
    """Build (or find cached) one extension, loaded as it was built and no further (no AMX switch: the moe
    library's comes with packed_gemm's)."""
    return _build(name, python_module=name not in TORCH_OP_LIBRARIES) is not None


def build_missing() -> list[str]:
    """Build every extension not yet in the cache, each in a process of its own, side by side (each build is
    one compiler at a time); the names that failed. Loads nothing into this process."""
    # The longest build first, on a core of its own; the others share the rest. More processes than cores
    # would only slow the longest one down.
    missing = sorted((name for name in SOURCES if not is_built(name)), key=lambda name: name != LONGEST_BUILD)
    if not missing:
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ProcessPoolExecutor(min(len(missing), cores), mp_context=multiprocessing.get_context("spawn")) as pool:
        built = list(pool.map(_build_one, missing))
    return [name for name, ok in zip(missing, built) if not ok]


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    failed = build_missing()
    print(
        f"tokenmill kernels ({cpu_isa()}, {kernel_folder()}): ready in {time.perf_counter() - started:.0f} s"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    import sys

    from tokenmill.ops.build import main as module_main  # the importable module's: its build processes find it

    sys.exit(module_main())
