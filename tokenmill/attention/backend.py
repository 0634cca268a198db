"""The attention backend interface and its selection by device."""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str
    # True when a decode step may be captured in a CUDA graph and replayed: the decode path reads only
    # device tensors, plus host values that the graph runner fixes at capture (see worker/cuda_graph.py).
    supports_cuda_graphs: bool

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, Hq, D]
        k: torch.Tensor,  # [num_tokens, Hkv, D]
        v: torch.Tensor,  # [num_tokens, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's k/v into the paged cache, then attend causally over each request's
        context (cached prefix + new tokens). Returns [num_tokens, Hq, D]."""
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new k/v rows into their cache slots (rounded to the cache's dtype). k, v: [num_tokens, Hkv, D]."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' picks the fast path for the device (Triton kernels on CUDA when triton imports, else SDPA);
    'triton' asks for the Triton kernels by name; 'torch_ref' is the readable reference."""
    from tokenmill.attention.cpu import SDPABackend
    from tokenmill.attention.torch_ref import TorchRefBackend
    from tokenmill.attention.triton import triton_unavailable_reason

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
