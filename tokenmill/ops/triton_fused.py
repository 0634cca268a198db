"""Fused element-wise Triton kernels for the decoder layer on CUDA: add + RMSNorm, per-head q/k RMSNorm +
rotary, SiLU-and-mul. One launch each where PyTorch takes several, with float32 round trips through memory.

Imports triton: reach it through `tokenmill.ops.triton_ops.triton_ops(x)`, which imports this module only
when a CUDA tensor asks and triton is installed.

The math runs in float32 registers; each value is rounded to the tensor's dtype where the PyTorch path
(and HF) rounds it, so 16-bit results equal it up to the order of the sums. FMA contraction is off for
the same reason: PyTorch's separate element-wise kernels round every product."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden], unit stride on hidden
    residual_ptr,  # [num_rows, hidden] the residual stream, += x (HAS_RESIDUAL; else unused)
    out_ptr,  # [num_rows, hidden] the normed rows (may be x itself)
    weight_ptr,  # [hidden]
    stride_x,
    stride_residual,
    stride_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * stride_residual + cols
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)  # rounded as `x + residual` is
        tl.store(residual_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)  # HF rounds before the weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the Triton RMSNorm takes [num_rows, hidden] tensors with unit stride on hidden.")
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        out,
        weight,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 512, 1), 16),
        enable_fp_fusion=False,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight of x [num_rows, hidden] (any row stride), as a new tensor."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [num_rows, hidden]
    _launch_rms_norm(x, None, out, weight, eps)
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, as the C++ `cpu_ops.add_rms_norm_`: residual += x, then x = rmsnorm(residual) * weight.
    x, residual: [num_rows, hidden], unit stride on hidden."""
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError("add_rms_norm_ needs a residual of x's shape with unit stride on hidden.")
    _launch_rms_norm(x, residual, x, weight, eps)


@triton.jit
def _norm_rope_heads(
    ptr,  # this token's first head: [NUM_HEADS, HEAD_DIM] at stride_head, unit stride on dims
    stride_head,
    weight_ptr,  # [HEAD_DIM] the per-head RMSNorm weight (HAS_NORM)
    cos,  # [1, HALF_PAD] float32
    sin,
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim / 2: dims [0, HALF) pair with [HALF, 2 * HALF); the rest pass through
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    dtype = ptr.dtype.element_ty
    heads = tl.arange(0, HEADS_PAD)[:, None]
    half = tl.arange(0, HALF_PAD)[None, :]
    rest = 2 * HALF + tl.arange(0, PASS_PAD)[None, :]
    rows = ptr + heads * stride_head  # [HEADS_PAD, 1]
    rot_mask = (heads < NUM_HEADS) & (half < HALF)  # [HEADS_PAD, HALF_PAD]
    pass_mask = (heads < NUM_HEADS) & (rest < HEAD_DIM)  # [HEADS_PAD, PASS_PAD]
    x1 = tl.load(rows + half, mask=rot_mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + HALF + half, mask=rot_mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # Qwen3: RMSNorm of each head (all HEAD_DIM dims), rounded as HF rounds, before rotary
        x3 = tl.load(rows + rest, mask=pass_mask, other=0.0).to(tl.float32)
        sum_sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(x3 * x3, 1)  # [HEADS_PAD]
        rstd = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]
        w1 = tl.load(weight_ptr + half, mask=half < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + half, mask=half < HALF, other=0.0).to(tl.float32)
        w3 = tl.load(weight_ptr + rest, mask=rest < HEAD_DIM, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x3 = w3 * (x3 * rstd).to(dtype).to(tl.float32)
        tl.store(rows + rest, x3.to(dtype), mask=pass_mask)
    tl.store(rows + half, (x1 * cos - x2 * sin).to(dtype), mask=rot_mask)
    tl.store(rows + HALF + half, (x2 * cos + x1 * sin).to(dtype), mask=rot_mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [num_tokens, Hq, D], unit stride on D
    k_ptr,  # [num_tokens, Hkv, D], unit stride on D
    cos_ptr,  # [num_tokens, rotary_dim / 2], unit stride on the last dim
    sin_ptr,
    q_weight_ptr,  # [D] (HAS_NORM)
    k_weight_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cos,
    stride_sin,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + half, mask=half < HALF, other=0.0).to(tl.float32)  # [1, HALF_PAD]
    sin = tl.load(sin_ptr + token * stride_sin + half, mask=half < HALF, other=0.0).to(tl.float32)
    _norm_rope_heads(
        q_ptr + token * stride_q_tok,
        stride_q_head,
        q_weight_ptr,
        cos,
        sin,
        eps,
        NUM_Q_HEADS,
        Q_HEADS_PAD,
        HEAD_DIM,
        HALF,
        HALF_PAD,
        PASS_PAD,
        HAS_NORM,
    )
    _norm_rope_heads(
        k_ptr + token * stride_k_tok,
        stride_k_head,
        k_weight_ptr,
        cos,
        sin,
        eps,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HEAD_DIM,
        HALF,
        HALF_PAD,
        PASS_PAD,
        HAS_NORM,
    )


def qk_norm_rope_(
    q: torch.Tensor,  # [num_tokens, Hq, D]
    k: torch.Tensor,  # [num_tokens, Hkv, D]
    rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [num_tokens, 1, rotary_dim / 2] (RotaryEmbedding)
    q_weight: torch.Tensor | None,  # [D]: per-head RMSNorm weights (Qwen3), or None for rotary alone
    k_weight: torch.Tensor | None,
    eps: float,
) -> None:
    """In place on q and k (views of the fused QKV output may be passed): optionally each head's RMSNorm,
    then rotary in the rotate-half layout on the first rotary_dim dims of each head (partial rotary:
    the rest pass through). Equals `RMSNorm` then `apply_rotary`'s PyTorch path."""
    cos, sin = rotary
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("qk_norm_rope_ needs unit stride on head_dim for q and k, and on cos and sin.")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope_ takes both q and k norm weights, or neither.")
    if num_tokens == 0:
        return
    half = cos.shape[-1]
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q_weight if q_weight is not None else q,
        k_weight if k_weight is not None else k,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        eps,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        PASS_PAD=triton.next_power_of_2(max(head_dim - 2 * half, 1)),
        HAS_NORM=has_norm,
        num_warps=4 if (num_q_heads + num_kv_heads) * head_dim >= 2048 else 1,
        enable_fp_fusion=False,
    )


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [num_tokens, 2 * INTER] = [gate | up], unit stride on the last dim
    out_ptr,  # [num_tokens, INTER]
    stride_in,
    stride_out,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu rounds before the product
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [num_tokens, 2 * n] [gate | up] projection: [num_tokens, n]."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        raise ValueError("silu_mul takes a [num_tokens, 2 * n] tensor with unit stride on the last dim.")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)  # [num_tokens, n]
    if num_tokens == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTER=inter,
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
        enable_fp_fusion=False,
    )
    return out
