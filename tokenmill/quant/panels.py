"""The packed weight layout of the C++ GEMM (csrc/packed_gemm.cpp): panels of 16 output channels.

bf16 panels store their channels interleaved, [0, 8, 1, 9, ..., 7, 15]: the kernel then splits one
32-byte load into channels 0-7 (the low halves of its 32-bit words) and 8-15 (the high halves) with
one shift and one mask, instead of two widening loads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 16  # output channels per packed panel
# stored position -> channel, for interleaved panels
INTERLEAVE = torch.arange(PANEL).view(2, PANEL // 2).t().reshape(-1)


def pack_panels(w: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: 16 output channels side by side for each input feature,
    zero rows padding the last panel."""
    out_features, in_features = w.shape
    num_panels = -(-out_features // PANEL)
    padded = F.pad(w, (0, 0, 0, num_panels * PANEL - out_features)).view(num_panels, PANEL, in_features)
    if interleave:
        padded = padded[:, INTERLEAVE]
    return padded.transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int, interleave: bool = False) -> torch.Tensor:
    if interleave:
        packed = packed[:, :, torch.argsort(INTERLEAVE)]
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]
