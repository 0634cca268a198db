"""LoRA updates in the AMX GEMM's epilogue (amx::LoRAEpilogue, models/layers/lora.py LoRALinear.apply):
the same output as the layer's GEMM then the update added after it (and then silu(gate) * up), for rows
of several adapters, of the base and of different ranks, on fused pieces (q|k|v, gate|up)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_amx_gemm import needs_amx
from tokenmill.models.layers.linear import silu_and_mul
from tokenmill.models.layers.lora import LoRAContext, LoRALinear, LoRARun
from tokenmill.ops import packed_gemm
from tokenmill.quant import Bf16Linear


def _lora(context: LoRAContext, in_features: int, sizes: list[int], ranks: list[int]) -> LoRALinear:
    lora = LoRALinear(context, len(ranks), max(ranks), in_features, sizes, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    for slot, rank in enumerate(ranks):
        pieces = [
            (torch.randn(rank, in_features, generator=generator), torch.randn(size, rank, generator=generator) * 0.1)
            for size in sizes
        ]
        lora.write(slot, rank, pieces)
    return lora


@needs_amx
@pytest.mark.parametrize(("sizes", "silu_mul"), [([96, 32, 32], False), ([64], False), ([128, 128], True)])
def test_the_epilogue_equals_the_update_added_after_the_gemm(sizes: list[int], silu_mul: bool) -> None:
    torch.manual_seed(0)
    in_features, rows = 80, 70
    layer = Bf16Linear(torch.randn(sum(sizes), in_features) * 0.1, torch.randn(sum(sizes)) * 0.1)
    context = LoRAContext()
    # Rows 0-9 the base, 10-39 slot 1 (rank 8), 40-44 the base, 45-69 slot 0 (rank 4): runs of several
    # tiles, a tile shared by two adapters and the base.
    context.set_runs([LoRARun(1, 10, 40, 8), LoRARun(0, 45, 70, 4)], rows)
    lora = _lora(context, in_features, sizes, [4, 8])
    x = torch.randn(rows, in_features)
    assert lora._in_epilogue(layer, x, silu_mul)
    got = lora.apply(layer, x, silu_mul)
    want = layer(x)
    lora.add_to(x, want)
    if silu_mul:
        want = silu_and_mul(want)
    assert not torch.equal(got[10:40], (silu_and_mul(layer(x)) if silu_mul else layer(x))[10:40])  # updated
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:10], (silu_and_mul(layer(x)) if silu_mul else layer(x))[:10])  # base rows as is


@needs_amx
def test_pieces_that_are_not_whole_panels_add_the_update_after_the_gemm() -> None:
    context = LoRAContext()
    context.set_runs([LoRARun(0, 0, 5, 4)], 5)
    lora = _lora(context, 32, [40, 24], [4])
    layer = Bf16Linear(torch.randn(64, 32), None)
    assert not lora._in_epilogue(layer, torch.randn(5, 32), False)


@needs_amx
def test_the_op_refuses_a_slot_or_rank_outside_its_tensors() -> None:
    """The epilogue trusts slot and rank to address t and bt: the op checks them first."""
    layer = Bf16Linear(torch.randn(32, 32), None)
    x, t, bt, ends = torch.randn(4, 32), torch.zeros(4, 8), torch.zeros(2, 8, 32), torch.tensor([32])
    rank = torch.full((4,), 4, dtype=torch.int32)
    for slot, ranks in ((torch.full((4,), 3, dtype=torch.int32), rank), (torch.zeros(4, dtype=torch.int32), rank * 4)):
        with pytest.raises(RuntimeError, match="out of range"):
            packed_gemm.packed_linear_lora(
                x, layer.packed, layer.ones, layer.bias, 32, False, (slot, ranks, t, bt, ends)
            )


@needs_amx
def test_ranks_above_the_epilogue_limit_add_the_update_after_the_gemm() -> None:
    """The epilogue's cost grows with the rank (float32 FMAs): above EPILOGUE_MAX_RANK the update is a
    BLAS product added after the GEMM, with the same result."""
    from tokenmill.models.layers.lora import EPILOGUE_MAX_RANK

    rank = 2 * EPILOGUE_MAX_RANK
    context = LoRAContext()
    context.set_runs([LoRARun(0, 0, 20, rank)], 20)
    lora = _lora(context, 64, [64], [rank])
    layer = Bf16Linear(torch.randn(64, 64) * 0.1, None)
    x = torch.randn(20, 64)
    assert not lora._in_epilogue(layer, x, False)
    want = layer(x)
    lora.add_to(x, want)
    torch.testing.assert_close(lora.apply(layer, x), want)
