"""GGUF blocks repacked into grouped weights (tokenmill/quant/gguf.py) dequantize to exactly what
gguf.quants.dequantize returns, type by type; the reference is gguf's own numpy code, in plain sight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokenmill.quant import dequantize_grouped
from tokenmill.quant.gguf import join_rows, repack

Q = GGMLQuantizationType
OUT, IN = 48, 512  # 16 blocks of 32 or 2 super-blocks of 256 per row


def _random_matrix(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((OUT, IN)) * rng.uniform(0.01, 1.0, (OUT, 1))).astype(np.float32)


def _k_quant_blocks(block_bytes: int, float_offsets: list[int], seed: int) -> np.ndarray:
    """Rows of valid K-quant super-blocks (gguf's Python cannot write them): random bytes with finite
    fp16 factors at `float_offsets`. [OUT, 2 * block_bytes] uint8."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (OUT, IN // 256, block_bytes), dtype=np.uint8)
    for offset in float_offsets:
        factor = (rng.standard_normal((OUT, IN // 256)) * 0.01).astype(np.float16)
        blocks[..., offset : offset + 2] = factor[..., None].view(np.uint8)
    return blocks.reshape(OUT, -1)


def _blocks(qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    if qtype == Q.Q4_K:  # d, dmin at bytes 0 and 2
        return _k_quant_blocks(144, [0, 2], seed)
    if qtype == Q.Q6_K:  # d at byte 208
        return _k_quant_blocks(210, [208], seed)
    return quantize(_random_matrix(seed), qtype)


def _gguf_reference(blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize(blocks, qtype), dtype=np.float32))  # [OUT, IN]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_repacked_weight_dequantizes_to_gguf_values_exactly(qtype: GGMLQuantizationType) -> None:
    blocks = _blocks(qtype)
    weight = repack(blocks, qtype, "blk.0.ffn_up.weight")
    assert torch.equal(dequantize_grouped(weight, IN), _gguf_reference(blocks, qtype))


@pytest.mark.parametrize(
    ("qtype", "bits", "group_size", "dtype", "with_minimums"),
    [
        (Q.Q8_0, 8, 32, torch.float16, False),
        (Q.Q4_0, 4, 32, torch.float16, False),
        (Q.Q4_1, 4, 32, torch.float16, True),
        (Q.Q5_0, 8, 32, torch.float16, False),
        (Q.Q5_1, 8, 32, torch.float16, True),
        (Q.Q4_K, 4, 32, torch.float32, True),
        (Q.Q6_K, 8, 16, torch.float32, False),
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_each_type_maps_to_its_grouped_format(
    qtype: GGMLQuantizationType, bits: int, group_size: int, dtype: torch.dtype, with_minimums: bool
) -> None:
    weight = repack(_blocks(qtype), qtype, "blk.0.ffn_up.weight")
    assert (weight.bits, weight.group_size, weight.scales.dtype) == (bits, group_size, dtype)
    assert (weight.minimums is not None) == with_minimums
    assert weight.levels.shape == (OUT, IN) and int(weight.levels.max()) < 1 << bits


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.IQ4_XS, Q.Q2_K], ids=lambda t: t.name)
def test_unsupported_type_is_an_error_naming_type_and_tensor(qtype: GGMLQuantizationType) -> None:
    with pytest.raises(ValueError, match=rf"blk\.3\.attn_v\.weight is {qtype.name}"):
        repack(np.zeros((4, 256), dtype=np.uint8), qtype, "blk.3.attn_v.weight")


@pytest.mark.parametrize(
    "types",
    # Q4_K_M's q/k/v; Q4_0 widened to 8 bits; Q4_1 with a part that gains a minimum; groups 32 and 16
    [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_0, Q.Q8_0), (Q.Q4_1, Q.Q8_0), (Q.Q8_0, Q.Q6_K), (Q.Q4_0, Q.Q4_1)],
    ids=lambda ts: "+".join(t.name for t in ts),
)
def test_fused_parts_of_different_types_join_into_one_exact_weight(types: tuple[GGMLQuantizationType, ...]) -> None:
    blocks = [_blocks(t, seed) for seed, t in enumerate(types)]
    parts = [repack(b, t, "part") for b, t in zip(blocks, types)]
    joined = join_rows(parts)
    assert joined.bits == max(p.bits for p in parts)
    assert joined.group_size == min(p.group_size for p in parts)
    assert (joined.minimums is not None) == any(p.minimums is not None for p in parts)
    expected = torch.cat([_gguf_reference(b, t) for b, t in zip(blocks, types)])
    assert torch.equal(dequantize_grouped(joined, IN), expected)


def test_a_row_parallel_rank_takes_whole_groups_of_columns_or_is_refused() -> None:
    from tokenmill.models.layers.linear import RowParallelLinear
    from tokenmill.worker.gguf_native import _input_slice

    weight = repack(_blocks(Q.Q4_1), Q.Q4_1, "blk.0.ffn_down.weight")  # groups of 32 over 512 columns
    layer = RowParallelLinear(IN, OUT)
    layer.in_features, layer.tp_rank = IN // 2, 1  # rank 1 of 2
    half, in_features = _input_slice(weight, layer)
    assert in_features == IN // 2
    assert torch.equal(dequantize_grouped(half, IN // 2), dequantize_grouped(weight, IN)[:, IN // 2 :])
    layer.in_features, layer.tp_rank = IN // 32, 3  # 16 columns: half a group
    with pytest.raises(ValueError, match="no whole groups of 32"):
        _input_slice(weight, layer)
