"""Tile steps shared by the prefill and decode kernels: where a tile of keys lives in the paged cache,
and the online-softmax update with that tile's values."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_kv_offsets(
    block_table,
    offs_n,
    n_valid,
    kv_head,
    stride_cache_block,
    stride_cache_off,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets of tokens `offs_n` of one sequence (its block table row) for one KV head, [BLOCK_N]."""
    block = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    kv_off = block * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_off
    return kv_off + kv_head * stride_cache_head


@triton.jit
def softmax_accumulate(qk, m_i, l_i, acc, v_cache_ptr, kv_off, dims, n_valid, dim_valid, DOT_PREC: tl.constexpr):
    """One online-softmax step (log2 domain) over a tile of masked scores qk [rows, BLOCK_N]: returns
    the new running max, running sum and accumulator. The caller guarantees a finite row max."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache_ptr + kv_off[:, None] + dims[None, :],
        mask=n_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [BLOCK_N, DIM_PAD]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc
