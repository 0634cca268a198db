"""The packed GEMM kernels (tokenmill/ops/csrc/packed_gemm.cpp) under Int8Linear and Bf16Linear, against
fp32 and the dequantized weights. The rounding bounds: tests/unit/test_quant.py; whole models:
tests/e2e/test_quant_e2e.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.unit.test_quant import random_weight
from tokenmill.ops import packed_gemm
from tokenmill.quant import Bf16Linear, Int8Linear
from tokenmill.quant.int8 import quantize_per_channel

needs_kernel = pytest.mark.skipif(not packed_gemm.available(), reason="the C++ int8 GEMM could not be built here")


@pytest.mark.parametrize("kernel", [pytest.param("cpu", marks=needs_kernel), "reference"])
@pytest.mark.parametrize(
    "num_tokens,in_features,out_features", [(1, 576, 960), (8, 64, 50), (13, 33, 17), (100, 1536, 48)]
)
def test_int8_linear_is_close_to_the_fp32_linear(
    kernel: str, num_tokens: int, in_features: int, out_features: int
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features)  # bias included
    x = torch.randn(num_tokens, in_features)
    expected = linear(x)
    got = Int8Linear.from_weight(linear.weight, linear.bias, kernel=kernel)(x)
    assert got.shape == (num_tokens, out_features)
    # Rounding error per weight is uniform in +-scale/2 with scale ~ 3.5 sigma / 127: ~1% of the output.
    assert (got - expected).norm() / expected.norm() < 0.02


def activations_as_seen(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the int8 kernel's integer path sees it, and the quantization step of each element [M, K]:
    AVX-512 VNNI: int8 groups of 32 values along K, steps of max|group| / 127; AVX2 (fewer than 512
    rows): int16 rows, steps of max|row| / 32767; AVX2 from 512 rows: x itself (a float32 GEMM)."""
    if packed_gemm.isa() == "avx512":
        num_rows, k = x.shape
        groups = nn.functional.pad(x, (0, (-k) % 32)).view(num_rows, -1, 32)  # [M, G, 32]
        amax = groups.abs().amax(dim=2, keepdim=True)
        q = torch.round(groups * (127 / amax)).nan_to_num()  # the kernel's float32 arithmetic, ties to even
        step = (amax / 127).expand_as(groups)
        return (q * step).reshape(num_rows, -1)[:, :k], step.reshape(num_rows, -1)[:, :k]
    if x.shape[0] >= 512:
        return x, torch.zeros_like(x)
    amax = x.abs().amax(dim=1, keepdim=True)
    step = (amax / 32767).expand_as(x)
    return torch.round(x * (32767 / amax)) * step, step


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 6, 7, 97, 200, 600])  # register tiles (odd K: padded), dense GEMM
def test_cpu_kernel_equals_dequantize_then_matmul(num_tokens: int) -> None:
    w, bias = random_weight(40, 77), torch.randn(40)
    x = torch.randn(num_tokens, 77)
    x[0, 32:64] = 0  # an all-zero activation group
    layer = Int8Linear.from_weight(w, bias, kernel="cpu")
    assert torch.equal(layer.int8_weight(), quantize_per_channel(w)[0])  # the packing round-trips
    seen, step = activations_as_seen(x)
    dequantized = layer.dequantize().double()
    expected = (seen.double() @ dequantized.T + bias.double()).float()
    magnitude = (seen.double().abs() @ dequantized.abs().T).float() + bias.abs()
    # int16 rows: float32 products often land on a half step, and the kernel may round such a tie the
    # other way (one step). int8 groups round exactly as the emulation does.
    one_step = 0 if packed_gemm.isa() == "avx512" else step.amax(dim=1, keepdim=True) * layer.dequantize().abs().amax()
    assert ((layer(x) - expected).abs() <= one_step + 1e-5 * (1 + magnitude)).all()
    # The activations' rounding error is bounded by half a step times the weights' magnitudes.
    bound = (step.double() / 2 @ dequantized.abs().T).float()
    exact = (x.double() @ dequantized.T + bias.double()).float()
    assert ((layer(x) - exact).abs() <= bound + 1e-5 * (1 + magnitude)).all()
    assert layer(x.bfloat16()).dtype == torch.bfloat16  # the model's dtype in, the same out


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 3, 7, 20, 130, 600])  # register tiles, pre-widened panels, dense GEMM
def test_bf16_linear_multiplies_the_bf16_weights_exactly(num_tokens: int) -> None:
    """float32 sums of exact products: of float32 activations (AVX2), or of activations rounded to bf16
    to nearest even (AVX-512 BF16 dot products)."""
    w, bias = random_weight(40, 77), torch.randn(40)
    x = torch.randn(num_tokens, 77)
    layer = Bf16Linear(w, bias)
    assert layer.packed.dtype == torch.bfloat16 and torch.equal(layer.weight_bf16(), w.bfloat16())
    seen = x.bfloat16() if packed_gemm.isa() == "avx512" else x
    expected = (seen.double() @ w.bfloat16().double().T + bias.double()).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 37, 300])  # streams (one row), register tiles, row blocks
@pytest.mark.parametrize("intermediate", [48, 40])  # halves of whole panels (fused), and not (split after)
def test_silu_and_mul_equals_the_activation_of_the_projection(kind: str, num_tokens: int, intermediate: int) -> None:
    """The MLP's gate and up projection with silu(gate) * up in the GEMM's epilogue gives what the plain
    projection followed by the activation gives."""
    w, bias = random_weight(2 * intermediate, 77, seed=3) * 0.1, torch.randn(2 * intermediate)
    x = torch.randn(num_tokens, 77)
    layer = Bf16Linear(w, bias) if kind == "bf16" else Int8Linear.from_weight(w, bias, kernel="cpu")
    gate, up = layer(x).chunk(2, dim=-1)
    got = layer.silu_and_mul(x)
    assert got.shape == (num_tokens, intermediate)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    if intermediate % 16:  # the fused op itself refuses halves that split a panel, with a reason
        weights = (layer.packed, layer.ones) if kind == "bf16" else (layer.qweight, layer.scale)
        with pytest.raises(RuntimeError, match="halves of whole panels"):
            torch.ops.tokenmill_quant.packed_linear_silu_mul(x, *weights, layer.bias, 2 * intermediate)
