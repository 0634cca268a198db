"""`tokenmill info`: the hardware as tokenmill sees it, and which kernel paths it selects there.

    tokenmill info                 # CPU, cores, instruction sets, kernel paths and builds, memory, GPU
    tokenmill info --bandwidth     # also a measured memory bandwidth (a timed 256 MB copy, about a second)
    tokenmill info --json          # the same as one JSON object
    tokenmill info MODEL           # whether tokenmill runs a model folder or .gguf file, and its shape

Nothing here builds a C++ kernel: the paths follow from the CPU flags and TOKENMILL_CPU_ISA, the same
answers tokenmill/ops/build.py gives the loader, and the builds are looked up in the kernel cache. A
bandwidth measurement is kept in tokenmill's cache: servers started later export the step loop's draw as a
share of it (tokenmill/metrics/bandwidth.py)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenmill.loader.model_source import resolve_dtype
from tokenmill.ops import build

# /proc/cpuinfo flag -> the name shown. avx512bw is listed because the AVX-512 kernels need it too.
ISA_FLAGS = {
    "avx2": "avx2",
    "fma": "fma",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512_bf16": "avx512_bf16",
    "avx512_vnni": "avx512_vnni",
    "amx": "amx_bf16",
    "amx_tile": "amx_tile",
}
# What the C++ headers test (#if __AVX512F__ && __AVX512BW__ && __AVX512BF16__ && __AVX512VNNI__).
_AVX512_KERNEL_FLAGS = ("avx512f", "avx512bw", "avx512_bf16", "avx512_vnni")
_BANDWIDTH_BYTES = 256 * 2**20


@dataclass
class KernelPaths:
    """The CPU paths tokenmill takes here, in words (docs/cpu.md)."""

    build: str  # "avx512+amx", "avx512", "avx2" or "scalar": the instruction sets the compiled kernels use
    auto_dtype: str  # what dtype="auto" picks for a 16-bit (bf16/fp16) checkpoint
    bf16_weights: str
    float32_weights: str
    int8_weights: str
    int4_weights: str
    attention: str
    int8_kv_cache: str


@dataclass
class KernelBuilds:
    """One instruction set's C++ kernels in the kernel cache (tokenmill/ops/kernel_cache.py)."""

    folder: str  # the cache folder of today's sources and flags for this instruction set
    built: dict[str, bool]  # extension -> compiled there (loads without a compiler)


@dataclass
class GpuInfo:
    name: str
    memory_gib: float
    compute_capability: str


@dataclass
class HardwareInfo:
    """What `tokenmill info` reports; `to_dict` is its --json form."""

    cpu_model: str
    logical_cores: int
    cpus_available: int
    torch_threads: int
    isa: dict[str, bool]
    cpu_isa_setting: str  # TOKENMILL_CPU_ISA: "native" or "avx2"
    kernel_paths: KernelPaths
    memory_total_gib: float | None
    memory_bandwidth_gb_s: float | None  # None unless measured (--bandwidth)
    gpu: GpuInfo | None
    kernels: dict[str, KernelBuilds]  # "native" (and "avx2" where this CPU runs it) -> its builds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what `platform` knows."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def isa_flags() -> dict[str, bool]:
    """Which of the instruction sets in ISA_FLAGS this CPU reports."""
    flags = {word for line in _cpuinfo_lines() if line.startswith("flags") for word in line.split()}
    return {name: flag in flags for name, flag in ISA_FLAGS.items()}


_SGEMM = "the BLAS sgemm (torch's float32 matmul)"


def kernel_paths(isa: dict[str, bool]) -> KernelPaths:
    """The paths the kernels compile to for these flags under the current TOKENMILL_CPU_ISA."""
    avx512 = build.cpu_has_avx512_bf16() and all(isa.get(flag, False) for flag in _AVX512_KERNEL_FLAGS)
    if avx512:
        amx = build.cpu_has_amx()  # the tile grant is asked for when the kernels load: not here
        return KernelPaths(
            build="avx512+amx" if amx else "avx512",
            auto_dtype=resolve_dtype("auto", "cpu", "bfloat16"),
            bf16_weights=(
                "AMX-BF16 tiles (tdpbf16ps) at every row count, float32 sums"
                if amx
                else "AVX-512 BF16 dot products (vdpbf16ps), float32 sums"
            ),
            float32_weights=_SGEMM,
            int8_weights=(
                "AMX-INT8 tiles (tdpbsud) from 8 rows, else VNNI (vpdpbusd), the same bits; activations in groups of 32"
                if amx
                else "VNNI int8 dot products (vpdpbusd), activations in groups of 32"
            ),
            int4_weights="unpacked in registers, VNNI int8 dot products (vpdpbusd), activations in groups of 32",
            attention=(
                "AVX-512 paged attention, its products on AMX tiles for a bf16 cache; decode and prompt rows"
                if amx
                else "AVX-512 paged attention over a bf16/int8 cache, decode and prompt rows"
            ),
            int8_kv_cache="yes",
        )
    widened = "widened to float32 in the GEMM" + (" (AVX2 FMA)" if build.cpu_has_avx2() else " (scalar)")
    return KernelPaths(
        build="avx2" if build.cpu_has_avx2() else "scalar",
        auto_dtype=resolve_dtype("auto", "cpu", "bfloat16"),
        bf16_weights=widened,
        float32_weights="AVX2 FMA tiles on float32 panels" if build.cpu_has_avx2() else _SGEMM,
        int8_weights="AVX2 int16 multiply-adds (vpmaddwd)" if build.cpu_has_avx2() else "scalar int8",
        int4_weights="AVX2 vpmaddubsw on activations in int8 groups of 32" if build.cpu_has_avx2() else "scalar int4",
        attention="portable C++ paged decode; prompt chunks through PyTorch SDPA",
        int8_kv_cache="no (needs the AVX-512 BF16 kernel)",
    )


def kernel_builds() -> dict[str, KernelBuilds]:
    """Which extensions are built, for the native build and (where the CPU runs it) the AVX2 one."""
    isas = ["native", "avx2"] if build.cpu_has_avx2() else ["native"]
    return {
        isa: KernelBuilds(str(build.kernel_folder(isa)), {name: build.is_built(name, isa) for name in build.SOURCES})
        for isa in isas
    }


def memory_total_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return None


def measure_bandwidth_gb_s(nbytes: int = _BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Best-of-`repeats` GB/s of a float32 tensor copy; a copy reads and writes each byte, so 2 x nbytes move."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def gpu_info() -> GpuInfo | None:
    """The first CUDA device, or None where torch sees none."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return GpuInfo(
        name=props.name, memory_gib=props.total_memory / 2**30, compute_capability=f"{props.major}.{props.minor}"
    )


def gather(bandwidth: bool = False) -> HardwareInfo:
    """Everything `tokenmill info` shows; `bandwidth` adds the (one-second) copy measurement."""
    import torch

    isa = isa_flags()
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return HardwareInfo(
        cpu_model=cpu_model_name(),
        logical_cores=os.cpu_count() or 1,
        cpus_available=available or 1,
        torch_threads=torch.get_num_threads(),
        isa=isa,
        cpu_isa_setting=build.cpu_isa(),
        kernel_paths=kernel_paths(isa),
        memory_total_gib=memory_total_gib(),
        memory_bandwidth_gb_s=measure_bandwidth_gb_s() if bandwidth else None,
        gpu=gpu_info(),
        kernels=kernel_builds(),
    )


def format_info(info: HardwareInfo) -> str:
    """The text form: one aligned row per fact."""
    paths = info.kernel_paths
    have = [name for name, present in info.isa.items() if present]
    missing = [name for name, present in info.isa.items() if not present]
    memory = "unknown" if info.memory_total_gib is None else f"{info.memory_total_gib:.1f} GiB"
    bandwidth = (
        "not measured (add --bandwidth)"
        if info.memory_bandwidth_gb_s is None
        else f"{info.memory_bandwidth_gb_s:.1f} GB/s (best float32 copy, read + write)"
    )
    gpu = (
        "none"
        if info.gpu is None
        else f"{info.gpu.name}, {info.gpu.memory_gib:.1f} GiB, compute capability {info.gpu.compute_capability}"
    )
    rows = [
        ("cpu", info.cpu_model),
        ("cores", f"{info.logical_cores} logical, {info.cpus_available} available, torch threads {info.torch_threads}"),
        ("instruction sets", " ".join(have) + (f" (no {' '.join(missing)})" if missing else "")),
        ("kernel build", f"{paths.build} (TOKENMILL_CPU_ISA={info.cpu_isa_setting})"),
        ('dtype="auto" (16-bit checkpoint)', paths.auto_dtype),
        ("bf16 weights", paths.bf16_weights),
        ("float32 weights", paths.float32_weights),
        ("int8 weights", paths.int8_weights),
        ("int4 weights", paths.int4_weights),
        ("attention", paths.attention),
        ("int8 KV cache", paths.int8_kv_cache),
        *((f"kernels ({isa})", _format_builds(builds)) for isa, builds in info.kernels.items()),
        ("memory", memory),
        ("memory bandwidth", bandwidth),
        ("gpu", gpu),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _format_builds(builds: KernelBuilds) -> str:
    missing = [name for name, built in builds.built.items() if not built]
    if not missing:
        return f"all {len(builds.built)} built, in {builds.folder}"
    return (
        f"not built: {', '.join(missing)} (compiled on first use, or now by `python -m tokenmill.ops.build`); "
        f"folder {builds.folder}"
    )


def add_info_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add `info` to the top-level `tokenmill` subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "info",
        help="the hardware as tokenmill sees it and the kernel paths it selects",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="a model folder or .gguf file: say whether tokenmill runs its architecture, with its family, "
        "layers, parameters and experts, without loading its weights (exit status 1 when it does not)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--bandwidth",
        action="store_true",
        help="measure memory bandwidth (about a second); the dashboard's panel 7 compares the step loop's draw with it",
    )
    parser.set_defaults(func=cmd_info)
    return parser


def cmd_info(args: argparse.Namespace) -> None:
    if args.model:
        _model_info(args.model, args.json)
        return
    info = gather(bandwidth=args.bandwidth)
    if info.memory_bandwidth_gb_s is not None:  # servers started later show their draw against it
        from tokenmill.metrics.bandwidth import save_measured_bandwidth

        save_measured_bandwidth(info.memory_bandwidth_gb_s)
    print(json.dumps(info.to_dict(), indent=2) if args.json else format_info(info))


def _model_info(model: str, as_json: bool) -> None:
    from tokenmill.bench.model_info import describe_model, format_model_info

    info = describe_model(model)
    print(json.dumps(info.to_dict(), indent=2) if as_json else format_model_info(info))
    if not info.supported:
        print(f"tokenmill: {info.message}", file=sys.stderr)
        sys.exit(1)


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        return []
