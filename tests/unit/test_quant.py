"""int8 weight quantization: the rounding bounds, and an unknown method refused. The GEMM kernels against
fp32: tests/kernels/test_quant_kernels.py; whole models against fp32: tests/e2e/test_quant_e2e.py."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineArgs
from tokenmill.engine.engine_args import create_engine_config
from tokenmill.quant.int8 import dequantize_per_channel, quantize_per_channel


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, so a per-tensor scale would fail where per-channel must not."""
    gen = torch.Generator().manual_seed(seed)
    row_scale = 10.0 ** torch.empty(out_features, 1).uniform_(-3, 1, generator=gen)
    return torch.randn(out_features, in_features, generator=gen) * row_scale


def test_round_trip_error_is_at_most_half_a_step_in_every_channel() -> None:
    w = random_weight(96, 200)
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    assert torch.equal(scale, w.abs().amax(dim=1) / 127)  # each row's largest magnitude maps to 127
    error = (dequantize_per_channel(q, scale) - w).abs().amax(dim=1)
    assert torch.all(error <= scale / 2 * (1 + 1e-5))
    assert q.abs().amax(dim=1).eq(127).all() and q.min() >= -127


def test_an_all_zero_channel_stays_zero() -> None:
    w = random_weight(4, 32)
    w[2] = 0
    q, scale = quantize_per_channel(w)
    assert torch.all(dequantize_per_channel(q, scale)[2] == 0) and torch.isfinite(scale).all()


def test_unknown_quantization_is_a_value_error_listing_the_options() -> None:
    with pytest.raises(ValueError, match="int8"):
        create_engine_config(EngineArgs(quantization="int3"))
