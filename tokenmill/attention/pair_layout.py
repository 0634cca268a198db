"""The pair layout of a bf16 KV cache that our AVX-512 BF16 attention kernel serves, in PyTorch.

The kernel (ops/csrc/paged_attention_avx512.h) reads keys and values straight from the blocks, so each
block stores them in the order its dot products take them; the C++ write_kv writes them so. Per
block half (K, V) and kv head, 16 tokens x D values:
    keys   [D/2, 16, 2]: (k[t, 2i], k[t, 2i + 1]) at [i, t]
    values [8, D, 2]:    (v[2s, d], v[2s + 1, d]) at [s, d]
The tensor keeps the shape [2, num_blocks, 16, Hkv, D] of the plain layout; only the order of the
values within each block differs. An int8 cache, [2, num_blocks, 16, Hkv, D + 4], holds the same order
in bytes, each head's 16 x D values followed by the 16 tokens' float32 scales. These conversions are
for tests and inspection, not the hot path."""

from __future__ import annotations

import torch

INT8_SCALE_BYTES = 4  # an int8 cache row's float32 scale, stored after its values


def cache_row_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements per (token, kv head) row of a cache tensor: an int8 row also holds its scale's bytes."""
    return head_dim + INT8_SCALE_BYTES if kv_cache_dtype == "int8" else head_dim


def to_pair_layout(cache: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, 16, Hkv, D] plain layout -> the same shape, blocks in the pair layout."""
    _, num_blocks, block, heads, dim = cache.shape
    k = cache[0].view(num_blocks, block, heads, dim // 2, 2).permute(0, 2, 3, 1, 4)  # [nb, Hkv, D/2, 16, 2]
    v = cache[1].view(num_blocks, block // 2, 2, heads, dim).permute(0, 3, 1, 4, 2)  # [nb, Hkv, 8, D, 2]
    return torch.stack([k.reshape(num_blocks, -1), v.reshape(num_blocks, -1)]).view(cache.shape)


def from_pair_layout(cache: torch.Tensor) -> torch.Tensor:
    """The inverse of to_pair_layout."""
    _, num_blocks, block, heads, dim = cache.shape
    k = cache[0].reshape(num_blocks, heads, dim // 2, block, 2).permute(0, 3, 1, 2, 4)  # [nb, 16, Hkv, D/2, 2]
    v = cache[1].reshape(num_blocks, heads, block // 2, dim, 2).permute(0, 2, 4, 1, 3)  # [nb, 8, 2, Hkv, D]
    return torch.stack([k.reshape(num_blocks, -1), v.reshape(num_blocks, -1)]).view(cache.shape)


def dequantize_int8_cache(cache: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, 16, Hkv, D + 4] int8 pair layout -> [2, num_blocks, 16, Hkv, D] float32 plain layout:
    each value times its token's scale."""
    _, num_blocks, block, heads, width = cache.shape
    dim = width - INT8_SCALE_BYTES
    chunks = cache.view(2, num_blocks, heads, block * width)
    values = chunks[..., : block * dim].float()  # [2, nb, Hkv, 16 * D]
    scales = chunks[..., block * dim :].contiguous().view(torch.float32)  # [2, nb, Hkv, 16]
    k = (
        values[0]
        .view(num_blocks, heads, dim // 2, block, 2)
        .permute(0, 3, 1, 2, 4)
        .reshape(num_blocks, block, heads, dim)
    )
    v = (
        values[1]
        .view(num_blocks, heads, block // 2, dim, 2)
        .permute(0, 2, 4, 1, 3)
        .reshape(num_blocks, block, heads, dim)
    )
    return torch.stack([k, v]) * scales.permute(0, 1, 3, 2).unsqueeze(-1)
