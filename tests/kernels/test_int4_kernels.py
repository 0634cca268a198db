"""The 4-bit GEMM (ops/csrc/packed_int4.h; packed_gemm_avx512.h's tile_grouped with AVX-512 VNNI) under
Int4Linear, against the dequantized weights times the activations as the kernel quantizes them
(int8 groups of 32 on every instruction set). The AVX2 build reruns this file. Quantization and
packing: tests/unit/test_int4_quant.py; the other grouped kinds (8 bits, float32 params, groups of
16): tests/kernels/test_grouped_kernels.py; whole models: tests/e2e/test_int4_e2e.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.avx2_rerun import avx2_rerun_test
from tests.kernels.grouped_weights import activations_as_seen
from tokenmill.ops import packed_gemm
from tokenmill.quant import Int4Linear

pytestmark = pytest.mark.skipif(not packed_gemm.available(), reason="the C++ packed GEMM could not be built here")


def reference(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """float64, so the only differences left are the kernel's float32 sums."""
    return (activations_as_seen(x).double() @ layer.dequantize().double().T + layer.bias[: layer.out_features]).float()


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("num_tokens", [1, 8, 100])  # decode, a batch, prefill; odd tile remainders
@pytest.mark.parametrize("in_features,out_features", [(256, 64), (200, 70)])  # K padded, last panel partial
def test_cpu_kernel_equals_the_dequantized_weights_times_the_quantized_activations(
    zero_point: bool, group_size: int, num_tokens: int, in_features: int, out_features: int
) -> None:
    torch.manual_seed(0)
    w, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(num_tokens, in_features)
    x[0, 32:64] = 0  # an all-zero activation group
    layer = Int4Linear.from_weight(w, bias, group_size, zero_point, kernel="cpu")
    got = layer(x)
    want = reference(layer, x)
    assert got.shape == (num_tokens, out_features)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_silu_and_mul_in_the_epilogue_equals_the_activation_of_the_projection(
    zero_point: bool, num_tokens: int
) -> None:
    torch.manual_seed(1)
    layer = Int4Linear.from_weight(torch.randn(2 * 64, 96), None, 32, zero_point, kernel="cpu")
    x = torch.randn(num_tokens, 96)
    gate, up = layer(x).chunk(2, dim=-1)
    torch.testing.assert_close(layer.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_a_row_gives_the_same_bits_alone_and_in_a_batch() -> None:
    """One sum per output in group order for every tile shape, as the int8 kernel: greedy decoding
    must not depend on the batch."""
    torch.manual_seed(2)
    layer = Int4Linear.from_weight(torch.randn(96, 128), torch.randn(96), 32, True, kernel="cpu")
    x = torch.randn(13, 128)
    batch = layer(x)
    for i in (0, 5, 12):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])


def test_a_weight_of_other_in_features_is_refused_with_the_sizes() -> None:
    layer = Int4Linear.from_weight(torch.randn(16, 64), None, 32, False, kernel="cpu")
    with pytest.raises(RuntimeError, match="x has 100 features, the int4 weight 64"):
        packed_gemm.packed_linear(torch.randn(1, 100), layer.qweight, layer.params, layer.bias, 16)


test_the_avx2_build_passes_these_tests = avx2_rerun_test(__file__)
