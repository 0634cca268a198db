"""The packed weight layout of the C++ GEMM (csrc/packed_gemm.cpp): panels of 16 output channels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 16  # output channels per packed panel


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: 16 output channels side by side for each input feature,
    zero rows padding the last panel."""
    out_features, in_features = w.shape
    num_panels = -(-out_features // PANEL)
    padded = F.pad(w, (0, 0, 0, num_panels * PANEL - out_features))
    return padded.view(num_panels, PANEL, in_features).transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]
