"""Scatter this step's keys and values into the paged KV cache, one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton.util import next_pow2


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [num_tokens, Hkv, D], any token/head strides, unit stride on D
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D], unit stride on D
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64; a negative slot marks a padding row: nothing is written
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_block,
    stride_cache_off,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (the page size)
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads_to_write = tl.where(slot >= 0, NUM_KV_HEADS, 0)  # (a scalar mask would do, but trips the interpreter)
    mask = (heads[:, None] < heads_to_write) & (dims[None, :] < HEAD_DIM)
    # The v cache has the k cache's strides (both are views of one [2, ...] tensor).
    dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_off
    dst += heads[:, None] * stride_cache_head + dims[None, :]  # [HEADS_PAD, DIM_PAD]
    k = tl.load(k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [num_tokens, Hkv, D]
    v: torch.Tensor,  # [num_tokens, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip (padding)
) -> None:
    """Like `tokenmill.attention.torch_ref.write_kv`, but rows whose slot is negative are skipped,
    so CUDA-graph padding rows need no reserved block."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("write_kv needs unit stride on head_dim for k, v and the KV cache.")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        HEADS_PAD=next_pow2(num_kv_heads),
        DIM_PAD=next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
