"""Top-k and top-p thresholds on the GPU with no host sync, for the rows whose filter reaches past their
top candidates (sample/distribution.py's `full` rows, rare for a trained model).

Which rows those are is known only on the device; choosing them on the host (to sort just them) waits
for the step's forward, and under async scheduling that wait is the overlap lost. Here one program per
row reads its flag; a flagged row finds the smallest logit it keeps by bisection over the order of the
float32 values (32 halvings of the int32 keys that order them, each a pass over the row), so there is
no sort of the vocabulary either. An unflagged row returns -inf: it keeps every token.

- top-k: the largest v with count(x >= v) >= k;
- top-p, over the top-k survivors renormalized: the largest v with mass(x >= v) >= p.

A token tied with the threshold is kept, as vLLM's top-k keeps ties (the CPU's sorted path keeps exactly
k, and picks among ties by position).

This module imports triton: import it only where triton is available."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per tile of a pass over a row.
BLOCK = 1024
_HALVINGS = tl.constexpr(32)  # int32 keys: 32 halvings narrow any range to one key
_KEY_MAX = tl.constexpr(2**31 - 1)
_KEY_MIN = tl.constexpr(-(2**31))


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _order_key(x: tl.tensor) -> tl.tensor:
    """float32 -> int64 with the same order (-inf lowest): the sign bit kept, a negative's other bits
    flipped. The same map takes a key back to the float's bits."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit  # type: ignore[untyped-decorator]
def _key_value(key: tl.tensor) -> tl.tensor:
    """The float32 whose _order_key is `key` (int64 within int32's range)."""
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit  # type: ignore[untyped-decorator]
def _count_from(base: tl.tensor, vocab_size: tl.tensor, key_min: tl.tensor, BLOCK: tl.constexpr) -> tl.tensor:
    """How many of the row's values have a key >= key_min: one pass over the row."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros((), tl.int64)
    for start in range(0, vocab_size, BLOCK):
        inside = start + offs < vocab_size
        key = _order_key(tl.load(base + start + offs, mask=inside, other=float("-inf")))
        count += tl.sum((inside & (key >= key_min)).to(tl.int64), 0)
    return count


@triton.jit  # type: ignore[untyped-decorator]
def _mass_from(
    base: tl.tensor, vocab_size: tl.tensor, key_min: tl.tensor, peak: tl.tensor, BLOCK: tl.constexpr
) -> tl.tensor:
    """The sum of exp(x - peak) over the row's values x with a key >= key_min: one pass over the row."""
    offs = tl.arange(0, BLOCK)
    mass = tl.zeros((), tl.float32)
    for start in range(0, vocab_size, BLOCK):
        inside = start + offs < vocab_size
        x = tl.load(base + start + offs, mask=inside, other=float("-inf"))
        mass += tl.sum(tl.where(inside & (_order_key(x) >= key_min), tl.exp(x - peak), 0.0), 0)
    return mass


@triton.jit  # type: ignore[untyped-decorator]
def _threshold_kernel(
    x_ptr: tl.tensor,  # [num_rows, vocab_size] float32 logits, unit stride on the vocabulary
    top_k_ptr: tl.tensor,  # [num_rows] int64, vocab_size where disabled
    top_p_ptr: tl.tensor,  # [num_rows] float32, 1.0 where disabled
    flag_ptr: tl.tensor,  # [num_rows] int8: 1 for a row to threshold
    out_ptr: tl.tensor,  # [num_rows] float32: the smallest logit kept
    vocab_size: tl.tensor,
    stride_row: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    threshold = tl.full((), float("-inf"), tl.float32)
    if tl.load(flag_ptr + row) != 0:
        k = tl.load(top_k_ptr + row)
        p = tl.load(top_p_ptr + row)
        # One pass: the row's largest logit and its smallest and largest keys.
        peak = tl.full((), float("-inf"), tl.float32)
        lo = tl.full((), _KEY_MAX, tl.int64)
        hi = tl.full((), _KEY_MIN, tl.int64)
        for start in range(0, vocab_size, BLOCK):
            inside = start + offs < vocab_size
            x = tl.load(base + start + offs, mask=inside, other=float("-inf"))
            key = _order_key(x)
            peak = tl.maximum(peak, tl.max(x, 0))
            lo = tl.minimum(lo, tl.min(tl.where(inside, key, _KEY_MAX), 0))
            hi = tl.maximum(hi, tl.max(tl.where(inside, key, _KEY_MIN), 0))
        # top-k: count(key >= lo) >= k holds (lo is the smallest key); keep it while halving [lo, hi].
        if k < vocab_size:
            k_hi = hi
            for _ in range(_HALVINGS):
                mid = lo + (k_hi - lo + 1) // 2
                enough = _count_from(base, vocab_size, mid, BLOCK) >= k
                lo = tl.where(enough, mid, lo)
                k_hi = tl.where(enough, k_hi, mid - 1)
        # top-p over the survivors: mass(key >= lo) = 1 >= p holds; keep it while halving [lo, hi].
        if p < 1.0:
            total = _mass_from(base, vocab_size, lo, peak, BLOCK)
            p_hi = hi
            for _ in range(_HALVINGS):
                mid = lo + (p_hi - lo + 1) // 2
                enough = _mass_from(base, vocab_size, mid, peak, BLOCK) >= p * total
                lo = tl.where(enough, mid, lo)
                p_hi = tl.where(enough, p_hi, mid - 1)
        threshold = _key_value(lo)
    tl.store(out_ptr + row, threshold)


def nucleus_thresholds(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    top_k: torch.Tensor,  # [num_rows] int64, vocab_size where disabled
    top_p: torch.Tensor,  # [num_rows] float32, 1.0 where disabled
    rows: torch.Tensor,  # [num_rows] bool: the rows to threshold
) -> torch.Tensor:
    """[num_rows] float32: each flagged row's smallest kept logit under its top-k, then its top-p; -inf
    for the other rows. `logits >= thresholds[:, None]` is what they keep."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1, "the kernel reads a row's logits contiguously"
    out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    flags = rows.to(torch.int8)
    _threshold_kernel[(num_rows,)](logits, top_k, top_p, flags, out, vocab_size, logits.stride(0), BLOCK=BLOCK)
    return out
