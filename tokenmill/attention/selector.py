"""Choose the attention backend for a device."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.cpu import SDPABackend
from tokenmill.attention.torch_ref import TorchRefBackend
from tokenmill.attention.triton import triton_unavailable_reason


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' picks the fast path for the device (Triton kernels on CUDA when triton imports, else SDPA);
    'triton' asks for the Triton kernels by name; 'torch_ref' is the readable reference."""
    if name == "torch_ref":
        return TorchRefBackend()
    if name == "auto" and device.type == "cuda" and triton_unavailable_reason() is None:
        name = "triton"
    if name == "triton":
        if (reason := triton_unavailable_reason()) is not None:
            raise ValueError(f"attention backend 'triton' cannot be used: {reason}; or use 'auto'.")
        from tokenmill.attention.triton.backend import TritonBackend

        return TritonBackend(device)
    if name in ("auto", "cpu"):
        return SDPABackend(device)
    if name == "sdpa":  # the same path without our C++ decode kernel
        return SDPABackend(device, use_cpp_kernels=False)
    raise ValueError(f"unknown attention backend {name!r}; use 'auto', 'cpu', 'sdpa', 'triton' or 'torch_ref'.")
