"""Fused element-wise ops for float32 CPU layers (models/layers/csrc/cpu_ops.cpp).

Each layer asks `cpu_ops(x)` and takes its plain PyTorch path when the answer is None: on GPU, in
other dtypes, or where the C++ extension could not be built."""

from __future__ import annotations

from types import ModuleType

import torch

from tokenmill import cpu_extensions


def cpu_ops(x: torch.Tensor) -> ModuleType | None:
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return cpu_extensions.load("cpu_ops")
