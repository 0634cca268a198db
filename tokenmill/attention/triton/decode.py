"""Paged decode attention (one query token per request) with split-K over the context.

Stage 1, grid (num_seqs, Hkv, num_splits): a program takes one request, the GROUP query heads that
share one KV head (padded to BLOCK_H >= 16 rows so tl.dot applies), and one contiguous slice of the
context. The slice length is computed on the device from the request's own seq_len,
ceil(ceil(seq_len / num_splits) / BLOCK_N) * BLOCK_N, so a fixed num_splits is right for every
context length (what CUDA graphs need: the grid is frozen at capture, the lengths are not).
Each program writes its normalised partial output and its log-sum-exp (base 2).

Stage 2, grid (num_seqs, Hq): weights each live split by exp2(lse - max lse) and sums. With one
split, stage 1 writes the final output itself and stage 2 is skipped."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton.tiles import paged_kv_offsets, softmax_accumulate
from tokenmill.attention.triton.util import dot_precision, next_pow2

MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256  # below this a split is mostly launch overhead


@dataclass(frozen=True)
class DecodeTiles:
    block_n: int = 64  # keys per inner-loop tile; split boundaries are multiples of it
    num_warps: int = 4
    num_stages: int = 2


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough programs to fill the GPU (about 4 per SM), never a split shorter than
    MIN_TOKENS_PER_SPLIT tokens of the longest context; a power of two, so few kernel variants."""
    programs = num_seqs * num_kv_heads
    want = min(-(-4 * num_sms // programs), -(-max_seq_len // MIN_TOKENS_PER_SPLIT), MAX_SPLITS)
    return 1 << (max(1, want).bit_length() - 1)


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, BLOCK_N)  # seq_len 0 (a padding row) must not divide by zero


@triton.jit
def _decode_partial_kernel(
    q_ptr,  # [num_seqs, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    part_out_ptr,  # [num_seqs, Hq, num_splits, D] fp32 (unused with ONE_SPLIT)
    part_lse_ptr,  # [num_seqs, Hq, num_splits] fp32 (unused with ONE_SPLIT)
    out_ptr,  # [num_seqs, Hq, D] (written only with ONE_SPLIT)
    scale,
    num_splits,
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_cache_block,
    stride_cache_off,
    stride_cache_head,
    stride_bt_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= max(16, GROUP)
    BLOCK_N: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start >= end:  # an empty split: stage 2 knows to skip it
        return

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        q_ptr + seq * stride_q_seq + head[:, None] * stride_q_head + dims[None, :], mask=io_mask, other=0.0
    )  # [BLOCK_H, DIM_PAD]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DIM_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    block_table = block_tables_ptr + seq * stride_bt_seq
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        kv_off = paged_kv_offsets(
            block_table, offs_n, n_valid, kv_head, stride_cache_block, stride_cache_off, stride_cache_head, BLOCK_SIZE
        )  # [BLOCK_N]
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + dims[:, None],
            mask=n_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )  # [DIM_PAD, BLOCK_N]
        qk = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale  # [BLOCK_H, BLOCK_N]
        qk = tl.where(n_valid[None, :], qk, float("-inf"))
        # finite row max: the tile's first key is valid
        m_i, l_i, acc = softmax_accumulate(qk, m_i, l_i, acc, v_cache_ptr, kv_off, dims, n_valid, dim_valid, DOT_PREC)

    part = acc / l_i[:, None]
    if ONE_SPLIT:
        tl.store(
            out_ptr + seq * stride_o_seq + head[:, None] * stride_o_head + dims[None, :],
            part.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        row = (seq * (GROUP * tl.num_programs(1)) + head) * num_splits + split  # [BLOCK_H]: (seq, head, split)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], part, mask=io_mask)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=row_valid)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,  # [num_seqs, Hq, num_splits, D] fp32
    part_lse_ptr,  # [num_seqs, Hq, num_splits] fp32
    seq_lens_ptr,
    out_ptr,  # [num_seqs, Hq, D]
    num_splits,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_live = tl.cdiv(seq_len, _split_len(seq_len, num_splits, BLOCK_N))  # splits stage 1 wrote
    splits = tl.arange(0, SPLITS_PAD)
    live = splits < num_live
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    row = (seq * tl.num_programs(1) + head) * num_splits + splits  # [SPLITS_PAD]; num_programs(1) = Hq
    lse = tl.load(part_lse_ptr + row, mask=live, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # 0 for dead splits; the max is finite when seq_len > 0
    part = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=live[:, None] & dim_valid[None, :], other=0.0
    )  # [SPLITS_PAD, DIM_PAD]
    out = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty), mask=dim_valid
    )


def decode_attention(
    q: torch.Tensor,  # [num_seqs, Hq, D]: one query token per request
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], this step's k/v already written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    out: torch.Tensor,  # [num_seqs, Hq, D], written
    scale: float,
    num_splits: int,
    tiles: DecodeTiles | None = None,
) -> None:
    """Each request's query attends to its whole context (no causal mask needed: it is the last token)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if num_seqs == 0:
        return
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}.")
    tiles = tiles or DecodeTiles()
    group = num_heads // num_kv_heads
    one_split = num_splits == 1
    if one_split:  # stage 1 writes `out`; pass it for the unused partial pointers too
        part_out = part_lse = out
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    dim_pad = max(16, next_pow2(head_dim))
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        out,
        scale,
        num_splits,
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
        DIM_PAD=dim_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=tiles.block_n,
        ONE_SPLIT=one_split,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if one_split:
        return
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        seq_lens,
        out,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        SPLITS_PAD=max(2, next_pow2(num_splits)),
        BLOCK_N=tiles.block_n,
        num_warps=1 if head_dim <= 64 else 2,
    )
