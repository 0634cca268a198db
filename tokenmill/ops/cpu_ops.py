"""Fused element-wise ops for float32 CPU layers (csrc/cpu_ops.cpp: add+RMSNorm, SiLU-and-mul,
in-place rotary, sampling rows).

Each caller asks `cpu_ops(x)` and takes its plain PyTorch path when the answer is None: on GPU, in
other dtypes, or where the C++ extension could not be built."""

from __future__ import annotations

from types import ModuleType

import torch

from tokenmill.ops import build


def cpu_ops(x: torch.Tensor) -> ModuleType | None:
    """The compiled cpu_ops module for a float32 CPU tensor `x`, else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return build.load("cpu_ops")
