"""Compile the Triton kernels that have not yet run on a GPU for an H100/H200 (sm_90), with no GPU: each
kernel's launch wrapper is called on small CPU tensors with the kernel replaced by a recorder, and the
recorded launch (argument types, constexprs, options) is compiled to a cubin by triton's own compiler
and ptxas. The interpreter runs a kernel's arithmetic but not its compile, where a type that changes
across a branch or a loop, or an op the GPU backend lacks, fails; this catches those before a GPU loan.

Run in its own process (it imports triton without TRITON_INTERPRET): `python -m tests.kernels.gpu_compile`.
Prints one line per compiled launch."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
_POINTER = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int8: "*i8",
}


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


def compile_launch(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Compile one recorded launch of `fn` for TARGET (raises on a compile error)."""
    values = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k in fn.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER[value.dtype]
        else:
            signature[param.name] = _scalar_type(value)
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET, options=options)


def record(module: ModuleType, name: str, launch: Callable[[], Any]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The launches of `module.name` that `launch()` makes, with the kernel replaced by a recorder."""
    recorder = _Recorder(getattr(module, name))
    setattr(module, name, recorder)
    try:
        launch()
    finally:
        setattr(module, name, recorder.fn)
    return recorder.launches


def _cases() -> list[tuple[ModuleType, str, str, Callable[[], Any]]]:
    from tokenmill.ops import triton_fused
    from tokenmill.sample import triton_nucleus, triton_sample

    bf16 = torch.bfloat16
    x, w = torch.zeros(4, 1024, dtype=bf16), torch.ones(1024, dtype=bf16)
    q, k = torch.zeros(4, 16, 128, dtype=bf16), torch.zeros(4, 8, 128, dtype=bf16)
    cos = sin = torch.zeros(4, 1, 64, dtype=torch.float32)
    logits, seeds = torch.zeros(4, 1000), torch.zeros(4, dtype=torch.int64)
    return [
        (triton_fused, "_rms_norm_kernel", "rms_norm", lambda: triton_fused.rms_norm(x, w, 1e-6)),
        (triton_fused, "_rms_norm_kernel", "add_rms_norm", lambda: triton_fused.add_rms_norm_(x, x.clone(), w, 1e-6)),
        (
            triton_fused,
            "_qk_norm_rope_kernel",
            "qk_norm_rope",
            lambda: triton_fused.qk_norm_rope_(q, k, (cos, sin), w[:128], w[:128], 1e-6),
        ),
        (
            triton_fused,
            "_qk_norm_rope_kernel",
            "rope",
            lambda: triton_fused.qk_norm_rope_(q, k, (cos, sin), None, None, 1e-6),
        ),
        (
            triton_fused,
            "_silu_mul_kernel",
            "silu_mul",
            lambda: triton_fused.silu_mul(torch.zeros(4, 2 * 3072, dtype=bf16)),
        ),
        (
            triton_sample,
            "_race_kernel",
            "race_logits",
            lambda: triton_sample.sample_logits(logits, torch.ones(4), seeds),
        ),
        (triton_sample, "_race_kernel", "race_probs", lambda: triton_sample.sample_probs(logits, seeds)),
        (
            triton_nucleus,
            "_threshold_kernel",
            "nucleus",
            lambda: triton_nucleus.nucleus_thresholds(
                logits, seeds + 1000, torch.ones(4), torch.ones(4, dtype=torch.bool)
            ),
        ),
    ]


def main() -> None:
    for module, name, label, launch in _cases():
        launches = record(module, name, launch)
        assert launches, f"{label}: {name} was not launched"
        for args, kwargs in launches:
            compile_launch(getattr(module, name), args, kwargs)
        print(f"compiled {label} ({name}) for sm_{TARGET.arch}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
