"""Random weights for any config, so real shapes can be benchmarked with nothing downloaded."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small normal weights (std 0.02) and unit norms: activations stay finite through every layer.
    Drawn on each parameter's own device (an 8B model's weights drawn on the CPU and copied take minutes;
    on a GPU, a second), by one generator per device: the same seed gives the same weights on one device."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            gen = generators[param.device]
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32, device=param.device) * 0.02
            param.copy_(values.to(param.dtype))
