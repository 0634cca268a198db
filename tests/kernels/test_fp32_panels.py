"""float32 weights in the packed GEMM's panels (quant/bf16.py Fp32Linear; AVX2 builds only): equal to the
float64 product, the same bits for a row alone or in a batch, and what a float32 engine runs on AVX2.
The native pass checks only that other builds refuse them; the AVX2 build runs this file again in a
subprocess (the last test)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernels.avx2_rerun import avx2_rerun_test
from tests.tiny_models import make_tiny_model
from tokenmill import LLM
from tokenmill.ops import packed_gemm
from tokenmill.quant import Fp32Linear

needs_avx2_build = pytest.mark.skipif(
    not packed_gemm.available() or packed_gemm.isa() != "avx2", reason="float32 panels are the AVX2 build's"
)


@pytest.mark.skipif(not packed_gemm.available() or packed_gemm.isa() == "avx2", reason="this is the AVX2 build")
def test_other_builds_refuse_float32_panels() -> None:
    with pytest.raises(ValueError, match="AVX2 build"):
        Fp32Linear(torch.randn(32, 16), None)


@needs_avx2_build
@pytest.mark.parametrize("num_rows", [1, 2, 7, 96, 100, 600])  # one row, tiles, whole and partial row blocks
# several k chunks (of 256); a partial last panel
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (300, 1000)])
def test_float32_panels_equal_the_float64_product(num_rows: int, in_features: int, out_features: int) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(num_rows, in_features, generator=gen)
    layer = Fp32Linear(w, bias)
    assert layer.packed.dtype == torch.float32
    expected = (x.double() @ w.double().T + bias.double()).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@needs_avx2_build
def test_silu_and_mul_of_float32_panels() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=gen) * 0.1  # [gate | up], 32 channels each: whole panels
    x = torch.randn(5, 48, generator=gen)
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    torch.testing.assert_close(
        Fp32Linear(w, None).silu_and_mul(x), (torch.nn.functional.silu(gate) * up).float(), rtol=1e-5, atol=1e-5
    )


@needs_avx2_build
@pytest.mark.parametrize("num_rows", [2, 5, 9, 17])
def test_a_rows_output_is_the_same_alone_and_in_a_batch(num_rows: int) -> None:
    gen = torch.Generator().manual_seed(2)
    layer = Fp32Linear(torch.randn(960, 576, generator=gen) * 0.05, None)
    x = torch.randn(num_rows, 576, generator=gen)
    assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(num_rows)]))


@needs_avx2_build
def test_a_float32_engine_runs_its_linear_layers_on_float32_panels(tmp_path: Path) -> None:
    llm = LLM(str(make_tiny_model(tmp_path, "llama")), dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, Fp32Linear)
    assert llm.engine.runner.fused_decode is not None  # the C++ decode stack takes them as packed layers


test_the_avx2_build_passes_these_tests = avx2_rerun_test(__file__)
