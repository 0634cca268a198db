"""Attention for variable-length queries over paged KV: prompts, prompt chunks after a cached
prefix (prefix-cache hits, chunked prefill), and mixed batches where some requests decode.

The step's k/v are written to the cache first, so every key (cached prefix and new tokens alike) is
read from the paged cache through the block table; no separate path for the new tokens.

Grid: (query blocks, Hkv). A program takes BLOCK_Q consecutive query tokens of one request and
all GROUP query heads that share one KV head, packed as BLOCK_M = BLOCK_Q * GROUP rows, so each
K/V tile is loaded once for the whole group (GQA). Query blocks are numbered over the flat batch
without a host-built index: request i owns programs [qsl[i] // BLOCK_Q + i, ...), which leaves room
for its ceil(q_len / BLOCK_Q) blocks; a program finds its request by binary search over qsl."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton.tiles import paged_kv_offsets, softmax_accumulate
from tokenmill.attention.triton.util import dot_precision, next_pow2


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # rows per program: query tokens x query heads of one KV head
    block_n: int  # keys per inner-loop tile
    num_warps: int = 4
    num_stages: int = 2


def default_prefill_tiles(head_dim: int, group: int, max_query_len: int) -> PrefillTiles:
    wide = next_pow2(head_dim) > 128
    block_m = 64 if wide else 128
    # Short queries (decode rows, speculative tokens) would leave most rows of a big tile empty.
    block_m = max(16, next_pow2(group), min(block_m, next_pow2(max_query_len * group)))
    return PrefillTiles(block_m, 32 if wide else 64, num_warps=8 if block_m >= 128 else 4)


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block_id, BLOCK_Q: tl.constexpr):
    """The last request i whose first query block (qsl[i] // BLOCK_Q + i) is <= q_block_id."""
    lo = 0
    hi = num_reqs  # the answer lies in [lo, hi)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_block <= q_block_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [num_tokens, Hq, D]
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32, context length after this step
    query_start_loc_ptr,  # [num_reqs + 1] int32
    scale,
    num_reqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_off,
    stride_cache_head,
    stride_bt_req,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_reqs, q_block_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_start = (q_block_id - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if q_block_start >= q_len:  # a spare program of this request's range
        return
    seq_len = tl.load(seq_lens_ptr + req)
    num_cached = seq_len - q_len  # tokens before this step's chunk

    rows = tl.arange(0, BLOCK_M)
    q_off = q_block_start + rows // GROUP  # token offset within the request's chunk
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (q_off < q_len)
    q_pos = num_cached + q_off  # position in the sequence; the row sees keys 0..q_pos
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token = (q_start + q_off).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, DIM_PAD]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    kv_end = tl.minimum(seq_len, num_cached + q_block_start + BLOCK_Q)  # last row's position + 1
    block_table = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        kv_off = paged_kv_offsets(
            block_table, offs_n, n_valid, kv_head, stride_cache_block, stride_cache_off, stride_cache_head, BLOCK_SIZE
        )  # [BLOCK_N]
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + dims[:, None],
            mask=n_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )  # [DIM_PAD, BLOCK_N]
        qk = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
        qk = tl.where(offs_n[None, :] <= q_pos[:, None], qk, float("-inf"))
        # Key 0 is in the first tile and visible to every row, so the row max is finite from there on.
        m_i, l_i, acc = softmax_accumulate(qk, m_i, l_i, acc, v_cache_ptr, kv_off, dims, n_valid, dim_valid, DOT_PREC)

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], this step's k/v already written
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    out: torch.Tensor,  # [num_tokens, Hq, D], written
    scale: float,
    max_query_len: int,
    tiles: PrefillTiles | None = None,
) -> None:
    """Causal attention of each request's new tokens over its whole context (cached + new)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0:
        return
    group = num_heads // num_kv_heads
    tiles = tiles or default_prefill_tiles(head_dim, group, max_query_len)
    if tiles.block_m < group:
        raise ValueError(f"block_m ({tiles.block_m}) must hold a whole GQA group ({group} heads).")
    block_q = tiles.block_m // group
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        num_reqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=tiles.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=tiles.block_n,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
