"""bf16 layers on AMX tiles (ops/csrc/packed_gemm_amx.h), on CPUs with AMX-BF16; the AVX-512 path on the
same packed weights is the one the switch (packed_gemm.set_amx) falls back to. The dispatch rules (flags,
TOKENMILL_AMX, a refused tile grant) are checked with the CPU's flags mocked, on any machine."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from tokenmill.ops import build, packed_gemm
from tokenmill.quant import Bf16Linear, Int8Linear

needs_amx = pytest.mark.skipif(
    not packed_gemm.amx(), reason="this CPU (or build) has no AMX-BF16 tiles: amx_tile and amx_bf16 flags needed"
)
needs_avx512 = pytest.mark.skipif(
    not (packed_gemm.available() and packed_gemm.isa() == "avx512"), reason="the AVX-512 BF16 build is not here"
)


@pytest.fixture
def amx_off() -> Iterator[None]:
    """The AVX-512 dot products on the same weights for one test."""
    was = packed_gemm.amx()
    packed_gemm.set_amx(False)
    yield
    packed_gemm.set_amx(was)


def without_amx(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """layer(x) on the AVX-512 kernels (the same packed weights), the AMX kernels back on after."""
    packed_gemm.set_amx(False)
    try:
        return layer(x)
    finally:
        packed_gemm.set_amx(True)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The GEMM's arithmetic in float64: activations rounded to bf16 (as the kernel rounds them), exact sums."""
    y = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T
    return (y if bias is None else y + bias.double()).float()


@needs_amx
@pytest.mark.parametrize("rows", [1, 8, 16, 100, 600])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (50, 100), (33, 577)])
def test_amx_bf16_gemm_matches_the_float_reference(rows: int, out_features: int, in_features: int) -> None:
    """Odd N (a partial last panel, a lone panel) and K (zero padding to whole tiles of 32 k)."""
    torch.manual_seed(rows + out_features)
    w = torch.randn(out_features, in_features) * 0.1
    bias = torch.randn(out_features)
    layer = Bf16Linear(w, bias)
    x = torch.randn(rows, in_features)
    y = layer(x)
    assert y.shape == (rows, out_features)
    torch.testing.assert_close(y, reference(x, w, bias), rtol=1e-5, atol=1e-4)


@needs_amx
@pytest.mark.parametrize("rows", [1, 8, 16, 100, 600])
def test_amx_silu_mul_epilogue_matches_the_reference(rows: int) -> None:
    torch.manual_seed(rows)
    w = torch.randn(2 * 64, 96) * 0.1  # [gate | up], halves of whole panels
    layer = Bf16Linear(w, None)
    x = torch.randn(rows, 96)
    gate, up = reference(x, w, None).chunk(2, dim=-1)
    torch.testing.assert_close(layer.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-4)


@needs_amx
@pytest.mark.parametrize("rows", [3, 17, 40])
def test_amx_rows_are_the_same_bits_alone_and_in_a_batch(rows: int) -> None:
    """Each C row depends on its own A row only: a row's output does not depend on the batch around it,
    whether the batch fills one tile, two, or leaves a partial one."""
    torch.manual_seed(rows)
    layer = Bf16Linear(torch.randn(80, 200) * 0.1, torch.randn(80))
    x = torch.randn(rows, 200)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(layer(x), alone)


@needs_amx
def test_amx_and_avx512_agree_to_float32_rounding_on_the_same_weights() -> None:
    """The switch flips paths between calls on the same packed weights: both are the same GEMM, summed in
    a different order."""
    torch.manual_seed(0)
    layer = Bf16Linear(torch.randn(64, 320) * 0.1, None)
    x = torch.randn(24, 320)
    on = layer(x)
    off = without_amx(layer, x)
    assert packed_gemm.amx()
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)
    assert not torch.equal(on, off) or x.abs().max() == 0  # a different order: the switch took effect


@needs_avx512
@pytest.mark.parametrize("rows", [1, 16, 100])
def test_the_avx512_fallback_reads_the_same_padded_panels(amx_off: None, rows: int) -> None:
    torch.manual_seed(rows)
    w = torch.randn(40, 70) * 0.1  # K padded to 96 for the tiles: the dot products read the zeros too
    layer = Bf16Linear(w, None)
    assert layer.packed.shape == (3, 96, 16)
    x = torch.randn(rows, 70)
    torch.testing.assert_close(layer(x), reference(x, w, None), rtol=1e-5, atol=1e-4)


@needs_amx
@pytest.mark.parametrize("rows", [8, 16, 100, 600])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (50, 100), (33, 577)])
def test_amx_int8_gemm_is_the_vnni_kernels_bits(rows: int, out_features: int, in_features: int) -> None:
    """AMX-INT8 reaches each 32-k group's exact integer sum and scales it as the VNNI tiles do, in group
    order: the same bits, so which kernel runs may depend on the row count."""
    torch.manual_seed(rows + in_features)
    layer = Int8Linear.from_weight(
        torch.randn(out_features, in_features) * 0.1, torch.randn(out_features), kernel="cpu"
    )
    x = torch.randn(rows, in_features)
    on = layer(x)
    off = without_amx(layer, x)
    assert torch.equal(on, off)
    assert layer.bias is not None
    expected = x @ layer.dequantize().T + layer.bias[:out_features]  # within int8 activations' error
    torch.testing.assert_close(on, expected, rtol=0.05, atol=0.05)


@needs_amx
@pytest.mark.parametrize("rows", [8, 40])
def test_amx_int8_silu_mul_is_the_vnni_kernels_bits(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Int8Linear.from_weight(torch.randn(2 * 64, 96) * 0.1, None, kernel="cpu")
    x = torch.randn(rows, 96)
    on = layer.silu_and_mul(x)
    off = without_amx(layer.silu_and_mul, x)
    assert torch.equal(on, off)


# ------------------------------------------------------------------------ dispatch, flags mocked
AMX_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"})


@pytest.fixture
def mocked_flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """build's view of the CPU and of TOKENMILL_AMX, set per test (its caches cleared before and after)."""
    build.amx_setting.cache_clear()
    packed_gemm._warn_amx_refused.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    build.amx_setting.cache_clear()
    packed_gemm._warn_amx_refused.cache_clear()


def test_amx_is_chosen_only_where_the_cpu_has_amx_bf16_tiles(mocked_flags: pytest.MonkeyPatch) -> None:
    mocked_flags.setattr(build, "_cpu_flags", lambda: AMX_FLAGS)
    mocked_flags.setattr(build, "cpu_isa", lambda: "native")
    assert build.cpu_has_amx()
    mocked_flags.setattr(build, "_cpu_flags", lambda: AMX_FLAGS - {"amx_bf16"})  # tiles without bf16: no
    assert not build.cpu_has_amx()
    mocked_flags.setattr(build, "_cpu_flags", lambda: AMX_FLAGS - {"amx_tile"})
    assert not build.cpu_has_amx()


def test_the_avx2_build_never_chooses_amx(mocked_flags: pytest.MonkeyPatch) -> None:
    mocked_flags.setattr(build, "_cpu_flags", lambda: AMX_FLAGS)
    mocked_flags.setattr(build, "cpu_isa", lambda: "avx2")
    assert not build.cpu_has_amx()


def test_tokenmill_amx_off_turns_it_off_and_bad_values_are_refused(mocked_flags: pytest.MonkeyPatch) -> None:
    mocked_flags.setattr(build, "_cpu_flags", lambda: AMX_FLAGS)
    mocked_flags.setattr(build, "cpu_isa", lambda: "native")
    mocked_flags.setenv(build.AMX_ENV, "off")
    assert not build.cpu_has_amx()
    build.amx_setting.cache_clear()
    mocked_flags.setenv(build.AMX_ENV, "sometimes")
    with pytest.raises(ValueError, match="TOKENMILL_AMX='sometimes': use one of"):
        build.amx_setting()


@pytest.mark.skipif(not packed_gemm.available(), reason="the packed GEMM could not be built here")
def test_a_refused_tile_grant_falls_back_with_one_warning(
    mocked_flags: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CPU says AMX, the kernel refuses the tile state: the AVX-512 path runs, and says so once."""
    mocked_flags.setattr(build, "_cpu_flags", lambda: AMX_FLAGS)
    mocked_flags.setattr(build, "cpu_isa", lambda: "native")
    mocked_flags.setattr(packed_gemm, "_amx_granted", lambda: False)
    with caplog.at_level(logging.WARNING, logger="tokenmill.ops.packed_gemm"):
        assert not packed_gemm.amx()
        assert not packed_gemm.amx()
    warnings = [r for r in caplog.records if "tile state was not granted" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.skipif(not packed_gemm.available(), reason="the packed GEMM could not be built here")
def test_no_warning_where_the_cpu_has_no_amx(
    mocked_flags: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    mocked_flags.setattr(build, "_cpu_flags", lambda: AMX_FLAGS - {"amx_tile", "amx_bf16"})
    mocked_flags.setattr(packed_gemm, "_amx_granted", lambda: False)
    with caplog.at_level(logging.WARNING, logger="tokenmill.ops.packed_gemm"):
        assert not packed_gemm.amx()
    assert not caplog.records
