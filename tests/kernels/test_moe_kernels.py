"""The mixture-of-experts op (ops/csrc/moe.h) under PackedExperts, against a per-expert Python loop over
the dense layers of the same precision (Bf16Linear, Int8Linear, Int4Linear: the same packed GEMM
kernels one expert at a time; float32: F.linear in float64): every expert's gate/up, silu * up, down and
the weighted sum per token, at 1, 8 and 100 tokens, top-k 1, 2 and 8, experts with no tokens. This
process runs the build's own paths (AVX-512 / AMX builds: the VNNI and bf16 dot-product tiles, float32
panels); the AVX2 build reruns the file (its float32, bf16, int8 and grouped tiles, also in one
region)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.kernels.avx2_rerun import avx2_rerun_test
from tokenmill.ops import moe
from tokenmill.quant import Bf16Linear, Int4Linear, Int8Linear, PackedExperts
from tokenmill.quant.int4 import quantize_groups

pytestmark = pytest.mark.skipif(not moe.available(), reason="the C++ mixture-of-experts op could not be built here")

NUM_EXPERTS, HIDDEN, INTERMEDIATE = 8, 64, 40  # 40: the intermediate size padded to whole panels


def dense_layer(kind: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """One expert's projection as the dense path runs it, in the same precision."""
    layer: nn.Module
    if kind == "float32":
        w64 = weight.double()
        return lambda x: F.linear(x.double(), w64).float()
    if kind == "bfloat16":
        layer = Bf16Linear(weight, None)
    elif kind == "int8":
        layer = Int8Linear.from_weight(weight, None, kernel="cpu")
    else:
        layer = Int4Linear.from_weight(weight, None, group_size=32, kernel="cpu")
    return lambda x: layer(x.contiguous())


def per_expert_loop(
    kind: str, w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The definition: each expert's chosen tokens through its layers, weighted and summed per token."""
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for e in range(NUM_EXPERTS):
        tokens, choice = (ids == e).nonzero(as_tuple=True)
        if not len(tokens):
            continue
        gate_up = dense_layer(kind, w13[e])(x[tokens])  # [n, 2 I]
        h = F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]
        down = dense_layer(kind, w2[e])(h)  # [n, H]
        out.index_add_(0, tokens, down.double() * weights[tokens, choice, None].double())
    return out.float()


def routing(num_tokens: int, top_k: int, num_used: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k distinct experts per token among the first num_used (the others get no token)."""
    ids = torch.stack([torch.randperm(num_used, generator=gen)[:top_k] for _ in range(num_tokens)])
    return ids, torch.rand(num_tokens, top_k, generator=gen)


TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "int8": 1e-4, "int4": 1e-4}  # of the output's largest value


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 2), (8, 2), (100, 2), (8, 1), (100, 8)])
@torch.inference_mode()
def test_one_call_equals_a_per_expert_loop(kind: str, num_tokens: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    ids, weights = routing(num_tokens, top_k, NUM_EXPERTS if top_k == 8 else 6, gen)  # experts 6, 7 idle
    experts = PackedExperts.from_weights(w13, w2, kind)
    got = experts(x, ids, weights)
    want = per_expert_loop(kind, w13, w2, x, ids, weights)
    assert got.shape == (num_tokens, HIDDEN) and got.dtype == torch.float32
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[kind] * scale)


@pytest.mark.parametrize("kind", ["bfloat16", "int8"])
@torch.inference_mode()
def test_the_output_keeps_the_input_dtype_and_every_token_its_own_rows(kind: str) -> None:
    """A token's result does not depend on the other tokens of the call (rows grouped by expert): on AMX
    too, where int8 experts with 8 rows or more and every bf16 expert take the tiles."""
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2
    experts = PackedExperts.from_weights(w13, w2, kind)
    x = torch.randn(20, HIDDEN, generator=gen)
    ids, weights = routing(20, 2, NUM_EXPERTS, gen)
    together = experts(x, ids, weights)
    alone = torch.cat([experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1]) for t in range(20)])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)
    assert experts(x.bfloat16(), ids, weights).dtype == torch.bfloat16


@torch.inference_mode()
def test_experts_from_per_expert_grouped_weights_equal_those_quantized_at_load() -> None:
    """The GGUF path's constructor (one GroupedWeight per expert and projection) packs what
    from_weights packs from the same levels."""
    gen = torch.Generator().manual_seed(4)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.2
    gate = [quantize_groups(w[:INTERMEDIATE], 32, zero_point=False) for w in w13]
    up = [quantize_groups(w[INTERMEDIATE:], 32, zero_point=False) for w in w13]
    down = [quantize_groups(w, 32, zero_point=False) for w in w2]
    grouped = PackedExperts.from_grouped(gate, up, down, HIDDEN, INTERMEDIATE)
    loaded = PackedExperts.from_weights(w13, w2, "int4")
    x = torch.randn(9, HIDDEN, generator=gen)
    ids, weights = routing(9, 2, NUM_EXPERTS, gen)
    torch.testing.assert_close(grouped(x, ids, weights), loaded(x, ids, weights), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one grouped weight per expert"):
        PackedExperts.from_grouped(gate, up[:-1], down, HIDDEN, INTERMEDIATE)


def test_an_expert_id_out_of_range_is_refused() -> None:
    experts = PackedExperts.from_weights(
        torch.zeros(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN), torch.zeros(NUM_EXPERTS, HIDDEN, INTERMEDIATE), "float32"
    )
    with pytest.raises(RuntimeError, match="expert id 8 out of range"):
        experts(torch.zeros(1, HIDDEN), torch.tensor([[8]]), torch.ones(1, 1))


test_the_avx2_build_passes_these_tests = avx2_rerun_test(__file__)
