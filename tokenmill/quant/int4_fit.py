"""The scales (and minimums) of 4-bit weight groups, fit at load time.

The plain grids, the largest magnitude at level -8 (llama.cpp's Q4_0) or the range split in 15 steps
(Q4_1), let one outlier set every other weight's step. So each group tries a few grids: the largest
magnitude at levels -9 to -6.5 in quarter steps (symmetric), or the range shrunk by up to 7% at either
end (with minimums). On each grid every weight is rounded to its nearest level, then the scale (and
minimum) is refit to those levels by least squares; the group keeps the fit with the smallest squared
error. The weights are then rounded to nearest once more, against the chosen values in float16
(quant/int4.py), so a plain grid is never worse than before and usually better."""

from __future__ import annotations

import torch

SYMMETRIC_TARGETS = tuple(-9.0 + 0.25 * i for i in range(11))  # the largest magnitude's level
RANGE_SHRINKS = (0.0, 0.035, 0.07)  # of the range, cut off at the minimum and at the maximum
# Rows fit at a time: each grid makes a few temporaries of this many groups' weights, kept in cache.
CHUNK_ELEMENTS = 1 << 18


def fit_symmetric(groups: torch.Tensor) -> torch.Tensor:
    """groups [out, G, n] float32 -> d [out, G] with w ~= d * level, level in -8..7."""
    rows = max(1, CHUNK_ELEMENTS // (groups.shape[1] * groups.shape[2]))
    return torch.cat([_fit_symmetric(chunk) for chunk in torch.split(groups, rows)])


def _fit_symmetric(groups: torch.Tensor) -> torch.Tensor:
    vmax = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True))  # [out, G, 1], signed
    inv = torch.where(vmax != 0, 1 / vmax, torch.zeros_like(vmax))
    best_gain, best_d = torch.full_like(vmax, -1.0), torch.zeros_like(vmax)
    for target in SYMMETRIC_TARGETS:
        q = torch.round(groups * (inv * target)).clamp_(-8, 7)
        swq, sqq = (groups * q).sum(2, keepdim=True), (q * q).sum(2, keepdim=True).clamp_min_(1e-30)
        # with d fit by least squares, d = swq / sqq and the squared error is sum(w^2) - swq^2 / sqq
        gain = swq * swq / sqq
        better = gain > best_gain  # ties keep the earlier grid
        best_gain, best_d = torch.where(better, gain, best_gain), torch.where(better, swq / sqq, best_d)
    return best_d.squeeze(2)


def fit_with_minimums(groups: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [out, G, n] float32 and valid [G, n] (False: K's padding, left out of the fit) ->
    (d, m) [out, G] with w ~= d * level + m, level in 0..15."""
    rows = max(1, CHUNK_ELEMENTS // (groups.shape[1] * groups.shape[2]))
    fits = [_fit_with_minimums(chunk, valid) for chunk in torch.split(groups, rows)]
    return torch.cat([d for d, _ in fits]), torch.cat([m for _, m in fits])


def _fit_with_minimums(groups: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    padded = not bool(valid.all())
    mask = valid.to(groups.dtype)  # [G, n]
    count = mask.sum(1, keepdim=True)  # [G, 1]
    lo = groups.masked_fill(~valid, float("inf")).amin(2, keepdim=True) if padded else groups.amin(2, keepdim=True)
    hi = groups.masked_fill(~valid, float("-inf")).amax(2, keepdim=True) if padded else groups.amax(2, keepdim=True)
    span = hi - lo
    sw = (groups * mask).sum(2, keepdim=True) if padded else groups.sum(2, keepdim=True)  # [out, G, 1]
    best_gain, best_d, best_m = torch.full_like(lo, float("-inf")), torch.zeros_like(lo), lo
    for low_cut in RANGE_SHRINKS:
        for high_cut in RANGE_SHRINKS:
            start = lo + low_cut * span
            inv = 15 / (span * (1 - low_cut - high_cut)).clamp_min(1e-30)
            q = torch.round((groups - start) * inv).clamp_(0, 15)
            if padded:
                q.mul_(mask)
            # least squares of d * q + m on the group's real weights: the 2 x 2 normal equations
            sq, sqq, swq = q.sum(2, keepdim=True), (q * q).sum(2, keepdim=True), (groups * q).sum(2, keepdim=True)
            det = count * sqq - sq * sq
            solvable = det > 0  # the levels are not all equal
            safe = torch.where(solvable, det, torch.ones_like(det))
            d = torch.where(solvable, (count * swq - sq * sw) / safe, torch.zeros_like(det))
            m = torch.where(solvable, (sw - d * sq) / count, sw / count)
            gain = d * swq + m * sw  # the squared error is sum(w^2) - gain at the least-squares fit
            better = gain > best_gain
            best_gain = torch.where(better, gain, best_gain)
            best_d, best_m = torch.where(better, d, best_d), torch.where(better, m, best_m)
    return best_d.squeeze(2), best_m.squeeze(2)
