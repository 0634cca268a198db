"""Grammar masks on the logits. A mask row has one bit per token, 32 to an int32 word, the layout
llguidance and xgrammar fill: bit j of word i allows token 32 * i + j."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The bits of float32 -inf (0xFF800000) as an int32.
_NEG_INF_BITS = -8388608


@dataclass
class TokenBitmask:
    """The tokens a step's constrained rows may pick (tokenmill.structured fills it)."""

    bits: torch.Tensor  # [num_constrained, num_words] int32, on the logits' device
    # The logits rows the mask rows are for; None: every row, in order.
    rows: torch.Tensor | None = None  # [num_constrained] int64


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Sets to -inf, in place, every token of a constrained row whose bit is 0; tokens past the mask's
    width are never allowed. `logits`: [num_reqs, vocab_size] float32."""
    penalty = bitmask_penalty(mask.bits, logits.shape[1])  # [num_constrained, vocab_size]
    if mask.rows is None:
        logits += penalty
    else:  # only the constrained rows: a batch's other rows cost nothing
        logits.index_add_(0, mask.rows, penalty)


def bitmask_penalty(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, num_words] int32 -> [n, vocab_size] float32: 0 where the token is allowed, -inf where not.

    Made with integer ops and added to the logits: on the CPU, a masked_fill with the unpacked bool
    mask costs several times more."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)  # [32]
    allowed = (bits.unsqueeze(-1) >> shifts) & 1  # [n, num_words, 32]
    # allowed - 1 is 0 (allowed) or all ones (banned), which `&` turns into -inf's bits.
    penalty = ((allowed - 1) & _NEG_INF_BITS).flatten(1).view(torch.float32)  # [n, 32 * num_words]
    if penalty.shape[1] >= vocab_size:
        return penalty[:, :vocab_size]
    return F.pad(penalty, (0, vocab_size - penalty.shape[1]), value=float("-inf"))
