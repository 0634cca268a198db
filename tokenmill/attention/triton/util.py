"""Small host-side helpers shared by the kernel launchers (no triton import)."""

from __future__ import annotations

import functools

import torch


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; a nominal 8 elsewhere (the interpreter on CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (tl.dot would use tf32 by default); 16-bit ones are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"
