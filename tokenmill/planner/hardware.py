"""Named hardware profiles and a roofline estimate of one replica's throughput on them.

The estimate is a ceiling, not a measurement: prefer `--throughput` or `--from-bench` when you have one.
With P prompt and O output tokens per request on a model of N parameters (2 bytes each, bf16):

    decode   tok/s = min(batch x bandwidth / weight bytes,  FLOPs / (2 N))   one weight read per step
    prefill  tok/s = FLOPs / (2 N)                                            compute-bound
    total    tok/s = (P + O) / (O / decode + P / prefill)                     the two phases do not overlap

It ignores the KV cache reads, attention FLOPs and kernel overheads, so real engines land below it.
The $/hour figures are editable defaults (rough on-demand cloud prices); `--cost-per-hour` overrides them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BYTES_PER_PARAM = 2  # bf16 weights
DEFAULT_PARAMS_B = 0.135  # the embedded SmolLM2-135M-Instruct
DEFAULT_BATCH = 64
# A nominal figure per core for "this-cpu" (AVX2 FMA in float32, a sustained ~half of peak); measure this
# machine with `tokenmill bench throughput --output-json` and pass `--from-bench` instead.
CPU_GFLOPS_PER_CORE = 50.0
CPU_BANDWIDTH_GB_S = 20.0


@dataclass(frozen=True)
class HardwareProfile:
    """One device (one replica) as the roofline sees it."""

    name: str
    bandwidth_gb_s: float  # memory bandwidth
    tflops: float  # dense bf16 (the CPU: a nominal float32 rate)
    cost_per_hour: float | None  # $ per device-hour; None: unknown
    note: str = ""


# Editable: change a price here (or pass --cost-per-hour) to match your contract.
GPU_PROFILES = {
    "h100": HardwareProfile("H100", 3350.0, 989.0, 2.50, "SXM 80 GB"),
    "h200": HardwareProfile("H200", 4800.0, 989.0, 3.50, "SXM 141 GB"),
    "a100": HardwareProfile("A100", 2039.0, 312.0, 1.80, "SXM 80 GB"),
    "l4": HardwareProfile("L4", 300.0, 121.0, 0.80, "24 GB"),
}


def this_cpu() -> HardwareProfile:
    """This machine's CPU with nominal rates (its cores x a per-core rate); no price."""
    cores = os.cpu_count() or 1
    flops = cores * CPU_GFLOPS_PER_CORE / 1000
    return HardwareProfile("this-cpu", CPU_BANDWIDTH_GB_S, flops, None, f"{cores} cores, nominal rates")


def hardware_names() -> list[str]:
    return [p.name for p in GPU_PROFILES.values()] + ["this-cpu"]


def get_profile(name: str) -> HardwareProfile:
    """The profile called `name` (case-insensitive)."""
    key = name.lower()
    if key == "this-cpu":
        return this_cpu()
    if key not in GPU_PROFILES:
        raise ValueError(f"unknown --hardware {name!r}: pick one of {', '.join(hardware_names())}.")
    return GPU_PROFILES[key]


def roofline_tok_s(
    profile: HardwareProfile,
    avg_input_tokens: float,
    avg_output_tokens: float,
    params_b: float = DEFAULT_PARAMS_B,
    batch: int = DEFAULT_BATCH,
) -> float:
    """The ceiling of one replica's total (prompt + output) tokens/s for this request mix (module docstring)."""
    if not params_b > 0:
        raise ValueError(f"--params must be > 0 (billions of parameters), got {params_b}.")
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}.")
    params = params_b * 1e9
    compute_tok_s = profile.tflops * 1e12 / (2 * params)
    memory_tok_s = batch * profile.bandwidth_gb_s * 1e9 / (params * BYTES_PER_PARAM)
    decode_tok_s = min(memory_tok_s, compute_tok_s)
    seconds = avg_output_tokens / decode_tok_s + avg_input_tokens / compute_tok_s
    return (avg_input_tokens + avg_output_tokens) / seconds
