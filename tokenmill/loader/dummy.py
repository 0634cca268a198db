"""Random weights for any config, so real shapes can be benchmarked with nothing downloaded."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small normal weights (std 0.02) and unit norms: activations stay finite through every layer."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.02
            param.copy_(values.to(param.dtype))
