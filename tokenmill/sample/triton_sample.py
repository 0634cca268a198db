"""The sampler's draw on GPU: one token per row in one pass over the vocabulary (the Gumbel-max trick).

With E_i ~ Exp(1) independent, argmax_i w_i / E_i (the exponential race) is token i with probability
w_i / sum(w). On probabilities the kernel races p_i / E_i; on logits it takes the same argmax in the
log domain, logits_i / temperature - log E_i (-log E_i is Gumbel noise), with no softmax. E_i comes
from Philox keyed by the row's seed, token t taking output t % 4 of counter t // 4. So there is no
[num_rows, vocab_size] noise tensor, no float64, no sort or cumulative sum, and a row's draw depends on
its seed alone, not on the batch or the tile size. A token of weight 0 (a -inf logit, a filtered-out
probability) never wins unless every token has weight 0: then the draw is token 0, as on CPU.

This module imports triton: import it only where triton is available (tokenmill.sample.sampler does,
lazily, on CUDA)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per tile: each row streams its logits once, in tiles of this many.
BLOCK = 2048
# Below this, -log(1 - w) loses digits to the rounding of 1 - w: the series w + w^2/2 + w^3/3 + w^4/4
# takes over (its first dropped term, w^5/5, is below float32's precision there).
_SERIES_BELOW = tl.constexpr(1.0 / 32.0)
_W_MAX = tl.constexpr(1.0 - 2.0**-24)  # the largest float32 below 1


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _race_kernel(
    x_ptr: tl.tensor,  # [num_rows, vocab_size] logits or probabilities, unit stride on the vocabulary
    seed_ptr: tl.tensor,  # [num_rows] int64: each row's Philox key
    temperature_ptr: tl.tensor,  # [num_rows] float32 (read with SCALE only)
    out_ptr: tl.tensor,  # [num_rows] int64
    vocab_size: tl.tensor,
    stride_row: tl.tensor,
    PROBS: tl.constexpr,  # x holds probabilities (race p / E), else logits (x / temperature - log E)
    SCALE: tl.constexpr,  # divide the logits by the row's temperature
    BLOCK: tl.constexpr,  # tokens per tile, a power of two >= 4
) -> None:
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + row)
    inv_t = 1.0
    if SCALE:
        inv_t = 1.0 / tl.load(temperature_ptr + row)
    # A tile is [BLOCK // 4, 4] tokens: one Philox call (4 outputs) serves tokens 4c .. 4c + 3.
    quads = tl.arange(0, BLOCK // 4)  # [BLOCK // 4]
    column = tl.arange(0, 4)[None, :]  # [1, 4]
    # Each lane keeps its best score and token; strict > keeps a lane's earliest on a tie.
    best = tl.full([BLOCK // 4, 4], float("-inf"), tl.float32)
    best_token = quads[:, None] * 4 + column  # [BLOCK // 4, 4]
    for start in range(0, vocab_size, BLOCK):
        counter = start // 4 + quads  # [BLOCK // 4]
        tokens = counter[:, None] * 4 + column  # [BLOCK // 4, 4]
        inside = tokens < vocab_size
        r0, r1, r2, r3 = tl.randint4x(seed, counter)  # [BLOCK // 4] uint32 each
        bits = tl.where(
            column < 2,
            tl.where(column == 0, r0[:, None], r1[:, None]),
            tl.where(column == 2, r2[:, None], r3[:, None]),
        )  # [BLOCK // 4, 4]: token 4c + j takes output j of counter c
        # E = -log(1 - w), w uniform in (0, 1) from 32 random bits: E keeps float32's precision down to
        # its smallest values, which decide the unlikely tokens' chances (-log(u) would round u near 1
        # to 1.0: E = 0, an infinite score). w stops below 1, so E stays finite: a token of positive
        # weight always beats one of weight 0.
        w = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, _W_MAX)  # (bits + 1/2) / 2^32
        series = w * (1.0 + w * (0.5 + w * (0.3333333333333333 + w * 0.25)))
        e = tl.where(w < _SERIES_BELOW, series, -tl.log(1.0 - w))
        x = tl.load(x_ptr + row * stride_row + tokens, mask=inside, other=0.0 if PROBS else float("-inf"))
        if PROBS:
            score = x.to(tl.float32) / e  # a probability of 0 scores 0: every positive one beats it
        else:
            score = x.to(tl.float32) * inv_t - tl.log(e)  # -inf for a -inf logit, whatever its noise
        better = score > best
        best = tl.where(better, score, best)
        best_token = tl.where(better, tokens, best_token)
    # The first token among the lanes' best (token 0 when every weight is 0).
    top = tl.max(tl.max(best, axis=1), axis=0)
    winner = tl.min(tl.min(tl.where(best == top, best_token, vocab_size), axis=1), axis=0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def sample_logits(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32 (or half precision), read only
    temperature: torch.Tensor | None,  # [num_rows] float32 > 0; None: the logits are scaled already
    seeds: torch.Tensor,  # [num_rows] int64
    block: int = BLOCK,
) -> torch.Tensor:
    """[num_rows] int64: one token per row from softmax(logits / temperature)."""
    return _race(logits, seeds, temperature, probs=False, block=block)


def sample_probs(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, nonnegative, read only; need not sum to 1
    seeds: torch.Tensor,  # [num_rows] int64
    block: int = BLOCK,
) -> torch.Tensor:
    """[num_rows] int64: one token per row, token i with probability probs[i] / sum(probs)."""
    return _race(probs, seeds, None, probs=True, block=block)


def _race(
    x: torch.Tensor,  # [num_rows, vocab_size]
    seeds: torch.Tensor,  # [num_rows] int64
    temperature: torch.Tensor | None,  # [num_rows] float32
    probs: bool,
    block: int,
) -> torch.Tensor:
    num_rows, vocab_size = x.shape
    if block < 4 or block & (block - 1):
        raise ValueError(f"block must be a power of two of at least 4, not {block}.")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)  # [num_rows]
    if num_rows == 0:
        return out
    _race_kernel[(num_rows,)](
        x,
        seeds,
        temperature if temperature is not None else seeds,  # never read without SCALE
        out,
        vocab_size,
        x.stride(0),
        PROBS=probs,
        SCALE=temperature is not None,
        BLOCK=block,
    )
    return out
