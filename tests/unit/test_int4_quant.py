"""Group-wise 4-bit quantization (tokenmill/quant/int4.py) and its packed layout (quant/panels.py), without
the C++ kernel: rounding bounds, the stored format, the options' validation. The GEMM:
tests/kernels/test_int4_kernels.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tokenmill.quant import Int4Linear, QuantOptions, check_quantization
from tokenmill.quant.grouped import dequantize_grouped
from tokenmill.quant.int4 import quantize_groups
from tokenmill.quant.panels import pack_grouped, unpack_grouped


def half_steps(scales: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """Half of each weight's group step, [out, in]: round-to-nearest's bound between two levels."""
    return (scales.float().abs() / 2).repeat_interleave(group_size, dim=1)[:, :in_features]


def absmax_grid_error(w: torch.Tensor, group_size: int, zero_point: bool) -> float:
    """The squared error of the plain grids (the largest magnitude at -8; the range in 15 steps)."""
    g = w.view(w.shape[0], -1, group_size)
    if zero_point:
        lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
        step = (hi - lo) / 15
        return float(((torch.round((g - lo) / step) * step + lo - g) ** 2).sum())
    d = g.gather(2, g.abs().argmax(2, keepdim=True)) / -8
    return float(((torch.round(g / d).clamp(-8, 7) * d - g) ** 2).sum())


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_weights_round_to_their_nearest_level_on_a_fit_no_worse_than_the_plain_grid(
    zero_point: bool, group_size: int
) -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 256) * torch.logspace(-3, 1, 24)[:, None]  # channels of very different ranges
    w[3, 7] = 40.0  # an outlier that the plain grid spends its whole range on
    q = quantize_groups(w, group_size, zero_point)
    assert q.levels.dtype == torch.uint8 and int(q.levels.max()) <= 15
    assert q.scales.shape == (24, 256 // group_size) and q.scales.dtype == torch.float16
    err = (dequantize_grouped(q, 256) - w).abs()
    inner = (q.levels > 0) & (q.levels < 15)  # not clamped at either end of the grid
    assert (err[inner] <= half_steps(q.scales, group_size, 256)[inner] * 1.001 + 1e-6).all()
    assert float((err**2).sum()) <= absmax_grid_error(w, group_size, zero_point) * 1.01


def test_symmetric_groups_on_a_grid_are_stored_exactly() -> None:
    w = torch.tensor([[0.5, -2.0, 1.0, 0.25] * 8])  # one group of 32, every value a multiple of 0.25
    q = quantize_groups(w, 32, zero_point=False)
    assert q.scales.item() == 0.25 and q.levels[0, 1].item() == 0  # -2 = 0.25 * (0 - 8)
    assert torch.equal(dequantize_grouped(q, 32), w)


def test_zero_point_groups_on_a_grid_are_stored_exactly_and_beat_symmetric_on_one_sign() -> None:
    w = (1.0 + 0.5 * torch.arange(16.0).repeat(2))[None]  # 1 .. 8.5: all positive, Q4_1's grid
    q = quantize_groups(w, 32, zero_point=True)
    assert q.minimums is not None and q.minimums.item() == 1.0 and q.scales.item() == 0.5
    assert torch.equal(dequantize_grouped(q, 32), w)
    symmetric = dequantize_grouped(quantize_groups(w, 32, zero_point=False), 32)
    assert (symmetric - w).abs().max() > 0.1


@pytest.mark.parametrize("zero_point", [False, True])
def test_a_group_padded_past_in_features_quantizes_as_its_real_weights_alone(zero_point: bool) -> None:
    torch.manual_seed(1)
    w = torch.randn(5, 72) + 3.0  # 72 = 32 + 32 + 8: the last group is 8 weights and 24 of padding
    q = quantize_groups(w, 32, zero_point)
    assert q.levels.shape == (5, 96) and dequantize_grouped(q, 72).shape == (5, 72)
    # the same 8 weights, repeated to fill a whole group, have the same fit as the padded group
    alone = quantize_groups(w[:, 64:].repeat(1, 4), 32, zero_point)
    torch.testing.assert_close(q.scales[:, 2], alone.scales[:, 0], rtol=2e-3, atol=0)
    torch.testing.assert_close(dequantize_grouped(q, 72)[:, 64:], dequantize_grouped(alone, 8), rtol=0, atol=1e-2)


@pytest.mark.parametrize("zero_point", [False, True])
def test_packing_round_trips_and_places_two_levels_a_byte(zero_point: bool) -> None:
    torch.manual_seed(2)
    q = quantize_groups(torch.randn(20, 64), 32, zero_point)  # 2 panels, the second partial
    packed, params = pack_grouped(*q)
    assert packed.shape == (2, 64, 8) and packed.dtype == torch.uint8
    assert params.shape == ((2, 2, 2, 16) if zero_point else (2, 2, 16))
    levels, scales, minimums, bits = unpack_grouped(packed, params, 20)
    assert bits == 4
    assert torch.equal(levels, q.levels) and torch.equal(scales, q.scales)
    assert (minimums is None) == (q.minimums is None)
    # The documented layout: channel c, k = 32 a + 16 h + 4 j + i sits in byte 256 a + 64 j + 4 c + i
    # of its panel, low nibble for h = 0, high for h = 1.
    c, a, h, j, i = 3, 1, 1, 2, 1
    byte = packed[0].reshape(-1)[256 * a + 64 * j + 4 * c + i].item()
    assert (byte >> 4 if h else byte & 0x0F) == q.levels[c, 32 * a + 16 * h + 4 * j + i].item()


def test_the_reference_kernel_multiplies_by_the_dequantized_weight() -> None:
    torch.manual_seed(3)
    w, bias, x = torch.randn(30, 64), torch.randn(30), torch.randn(4, 64)
    layer = Int4Linear.from_weight(w, bias, 32, False, kernel="reference")
    torch.testing.assert_close(layer(x), x @ layer.dequantize().T + bias)
    assert layer.dequantize().shape == (30, 64)


@pytest.mark.parametrize(
    "name,options,message",
    [
        ("int4", QuantOptions(group_size=64), "int4 group size 64 is not supported; use one of"),
        ("int8", QuantOptions(group_size=32), "int8 has one scale per output channel"),
        ("int8", QuantOptions(zero_point=True), "int8 has one scale per output channel"),
        (None, QuantOptions(zero_point=True), "need --quantization int4"),
        ("int3", QuantOptions(), "unknown quantization 'int3'"),
    ],
)
def test_options_a_method_does_not_take_are_refused_with_what_to_use(
    name: str | None, options: QuantOptions, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_quantization(name, options)


def test_int4_takes_both_group_sizes_and_a_zero_point() -> None:
    for options in (QuantOptions(), QuantOptions(32, True), QuantOptions(128), QuantOptions(128, True)):
        check_quantization("int4", options)


def test_llamacpp_q4_weights_are_quantized_by_llama_cpp_from_its_f32_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench compare --dtype q4_0 / q4_1: llama.cpp's converter writes no 4-bit types, so the peer
    converts to f32 once and runs llama.cpp's own quantizer on that file."""
    from tokenmill.bench.peers import llamacpp

    commands: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        Path(command[command.index("--outfile") + 1] if "--outfile" in command else command[-2]).write_text("gguf")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(llamacpp.subprocess, "run", fake_run)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    q4_0 = llamacpp._prepare(tmp_path / "peer", model, "q4_0")
    assert q4_0.name == "model-q4_0.gguf" and q4_0.exists()
    convert, quantize = commands
    assert convert[convert.index("--outtype") + 1] == "f32"
    f32 = Path(convert[convert.index("--outfile") + 1]).with_name("model-f32.gguf")
    assert quantize[-3] == str(f32) and quantize[-1] == "q4_0" and "llama_model_quantize" in quantize[2]
    llamacpp._prepare(tmp_path / "peer", model, "q4_1")  # the f32 file is reused
    assert len(commands) == 3 and commands[2][-1] == "q4_1"
