"""The grouped-weight GEMM (ops/csrc/packed_int4.h; packed_gemm_avx512.h's tile_grouped with AVX-512
VNNI) under GroupedLinear, for every kind of weight GGUF files and int4 bring (bits 4 and 8, float16
and float32 params, with and without minimums, groups of 16, 32 and 128), against dequantize_grouped
times the activations as the kernel quantizes them. The AVX2 build reruns this file. int4's own
quantization: tests/unit/test_int4_quant.py; whole models: tests/e2e/test_int4_e2e.py."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.avx2_rerun import avx2_rerun_test
from tests.kernels.grouped_weights import activations_as_seen, random_grouped
from tokenmill.ops import packed_gemm
from tokenmill.quant.grouped import GroupedLinear, GroupedWeight, dequantize_grouped
from tokenmill.quant.panels import pack_grouped, unpack_grouped

needs_kernel = pytest.mark.skipif(not packed_gemm.available(), reason="the C++ packed GEMM could not be built here")

KINDS = list(itertools.product([4, 8], [torch.float16, torch.float32], [False, True], [16, 32, 128]))


def kind_id(kind: tuple[int, torch.dtype, bool, int]) -> str:
    bits, dtype, minimums, group_size = kind
    return f"int{bits}-{str(dtype).removeprefix('torch.')}-{'min' if minimums else 'sym'}-g{group_size}"


def reference(weight: GroupedWeight, in_features: int, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float64, so the only differences left are the kernel's float32 sums."""
    w = dequantize_grouped(weight, in_features).double()
    return (activations_as_seen(x).double() @ w.T + bias.double()).float()


@needs_kernel
@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_cpu_kernel_equals_the_dequantized_weights_times_the_quantized_activations(
    kind: tuple[int, torch.dtype, bool, int],
) -> None:
    torch.manual_seed(0)
    bits, dtype, minimums, group_size = kind
    for in_features, out_features in [(256, 64), (200, 70)]:  # K padded (to 32 as well), last panel partial
        weight = random_grouped(out_features, in_features, bits, dtype, minimums, group_size)
        bias = torch.randn(out_features)
        layer = GroupedLinear(weight, in_features, bias, kernel="cpu")
        for num_tokens in (1, 8, 100):  # decode, a batch, prefill; odd tile remainders
            x = torch.randn(num_tokens, in_features)
            x[0, 32:64] = 0  # an all-zero activation group
            got, want = layer(x), reference(weight, in_features, bias, x)
            assert got.shape == (num_tokens, out_features)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_reference_kernel_is_dequantize_grouped_then_linear(kind: tuple[int, torch.dtype, bool, int]) -> None:
    torch.manual_seed(1)
    bits, dtype, minimums, group_size = kind
    weight = random_grouped(20, 72, bits, dtype, minimums, group_size)
    bias, x = torch.randn(20), torch.randn(3, 72)
    layer = GroupedLinear(weight, 72, bias, kernel="reference")
    torch.testing.assert_close(layer(x), F.linear(x, dequantize_grouped(weight, 72), bias))


def test_dequantize_grouped_follows_the_formulas_in_float32() -> None:
    levels = torch.tensor([[0, 1, 15, 8] * 4], dtype=torch.uint8)  # [1, 16]: one group of 16
    scales = torch.tensor([[0.5]])
    want_symmetric = 0.5 * (levels.float() - 8)
    assert torch.equal(dequantize_grouped(GroupedWeight(levels, scales, None, 4), 16), want_symmetric)
    minimums = torch.tensor([[-1.25]])
    want_minimums = 0.5 * levels.float() - 1.25
    assert torch.equal(dequantize_grouped(GroupedWeight(levels, scales, minimums, 8), 16), want_minimums)
    assert torch.equal(dequantize_grouped(GroupedWeight(levels, scales, None, 8), 16), 0.5 * (levels.float() - 128))


@pytest.mark.parametrize("minimums", [False, True])
def test_8_bit_packing_round_trips_and_keeps_the_int8_quad_order(minimums: bool) -> None:
    torch.manual_seed(2)
    weight = random_grouped(20, 64, 8, torch.float32, minimums, 16)  # 2 panels, the second partial
    packed, params = pack_grouped(*weight)
    assert packed.shape == (2, 64, 16) and packed.dtype == torch.uint8 and params.dtype == torch.float32
    assert params.shape == ((2, 4, 2, 16) if minimums else (2, 4, 16))
    levels, scales, mins, bits = unpack_grouped(packed, params, 20)
    assert bits == 8 and torch.equal(levels, weight.levels) and torch.equal(scales, weight.scales)
    assert (mins is None) == (weight.minimums is None)
    # The documented layout: channel c, k sits in byte 64 (k // 4) + 4 c + k % 4 of its panel.
    c, k = 5, 37
    assert packed[0].reshape(-1)[64 * (k // 4) + 4 * c + k % 4].item() == weight.levels[c, k].item()


@needs_kernel
def test_groups_of_16_ending_half_way_through_an_activation_group_are_padded() -> None:
    torch.manual_seed(3)
    weight = random_grouped(16, 48, 8, torch.float32, False, 16)  # 3 groups: K padded to 64 in the layer
    layer = GroupedLinear(weight, 48, None, kernel="cpu")
    assert layer.qweight.shape[1] == 64
    x = torch.randn(2, 48)
    want = reference(weight, 48, torch.zeros(16), x)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    torch.testing.assert_close(layer.dequantize(), dequantize_grouped(weight, 48), rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_silu_and_mul_in_the_epilogue_equals_the_activation_of_the_8_bit_projection(num_tokens: int) -> None:
    torch.manual_seed(4)
    layer = GroupedLinear(random_grouped(2 * 64, 96, 8, torch.float32, True, 16), 96, None, kernel="cpu")
    x = torch.randn(num_tokens, 96)
    gate, up = layer(x).chunk(2, dim=-1)
    torch.testing.assert_close(layer.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gives_the_same_bits_alone_and_in_a_batch_with_groups_of_16(bits: int) -> None:
    torch.manual_seed(5)
    layer = GroupedLinear(random_grouped(96, 128, bits, torch.float32, True, 16), 128, torch.randn(96), "cpu")
    x = torch.randn(13, 128)
    batch = layer(x)
    for i in (0, 5, 12):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda w: w._replace(bits=6), "take \\(4, 8\\) bits"),
        (lambda w: w._replace(levels=w.levels | 0x10), "below 16"),
        (lambda w: w._replace(scales=w.scales.double()), "float16 or float32"),
        (lambda w: w._replace(minimums=torch.zeros(16, 1, dtype=torch.float32)), "scales' shape and dtype"),
        (lambda w: w._replace(levels=w.levels.repeat(1, 2)), "group size must be one of"),
    ],
)
def test_a_malformed_weight_is_refused_with_what_is_wrong(change: object, message: str) -> None:
    weight = random_grouped(16, 32, 4, torch.float16, True, 32)
    with pytest.raises(ValueError, match=message):
        GroupedLinear(change(weight), 32, None, kernel="reference")  # type: ignore[operator]


def test_in_features_that_do_not_fit_the_groups_are_refused() -> None:
    weight = random_grouped(16, 64, 8, torch.float32, False, 16)
    with pytest.raises(ValueError, match="40 in-features do not fit 64 levels"):
        GroupedLinear(weight, 40, None, kernel="reference")


test_the_avx2_build_passes_these_tests = avx2_rerun_test(__file__)
