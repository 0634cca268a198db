"""GGUF's quantized blocks repacked, exactly, into grouped weights (quant/grouped.py), so a .gguf
file's linear layers run in the format they were quantized to (``--quantization gguf``).

    weight = repack(tensor.data, tensor.tensor_type, tensor.name)   # rows of raw blocks -> GroupedWeight

Each type maps onto ``w = scale * (level - 2 ** (bits - 1))`` or ``w = scale * level + minimum`` with
the very float32 operations gguf's own dequantization does, so ``dequantize_grouped`` returns
gguf.quants.dequantize's values bit for bit (tests/unit/test_gguf_repack.py):

| type | block                                   | bits | group | params  | level       | minimum   |
|------|-----------------------------------------|------|-------|---------|-------------|-----------|
| Q8_0 | d f16, 32 x int8 q                      | 8    | 32    | f16 d   | q + 128     | -         |
| Q4_0 | d f16, 32 nibbles q (w = d (q - 8))     | 4    | 32    | f16 d   | q           | -         |
| Q4_1 | d, m f16, 32 nibbles q (w = d q + m)    | 4    | 32    | f16 d   | q           | f16 m     |
| Q5_0 | d f16, 32 x 5-bit q (w = d (q - 16))    | 8    | 32    | f16 d   | q + 112     | -         |
| Q5_1 | d, m f16, 32 x 5-bit q (w = d q + m)    | 8    | 32    | f16 d   | q           | f16 m     |
| Q4_K | 256: d, dmin f16, 8 x 6-bit sc and m    | 4    | 32    | f32 d sc| q           | -dmin m   |
| Q6_K | 256: 6-bit q, 16 x int8 sc, d f16       | 8    | 16    | f32 d sc| q + 96      | -         |

(Q6_K's q is stored as q6 in 0..63 for w = d sc (q6 - 32); level - 128 = q6 - 32. Q5_0 and Q5_1 are
llama.cpp's fallback for matrices whose rows are no multiple of 256, e.g. in Qwen2.5-0.5B's Q4_K_M.)
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K as GGUF_Q4_K

from tokenmill.quant.grouped import GroupedWeight

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
_BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q4_K: 144, Q.Q6_K: 210}


def repack(data: np.ndarray, qtype: GGMLQuantizationType, name: str) -> GroupedWeight:
    """Raw GGUF rows ([out, bytes per row] uint8, as GGUFReader maps them) -> the GroupedWeight that
    dequantizes to gguf's values exactly. Unsupported types are a ValueError naming type and tensor."""
    if qtype not in _BLOCK_BYTES:
        raise ValueError(
            f"tensor {name} is {qtype.name}: --quantization gguf serves {[t.name for t in SUPPORTED_TYPES]} "
            "(and float tensors); run this file without --quantization to expand it to bf16."
        )
    rows = np.ascontiguousarray(data).view(np.uint8)
    blocks = rows.reshape(rows.shape[0], -1, _BLOCK_BYTES[qtype])  # [out, blocks per row, bytes]
    unpack = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
    return unpack[qtype](blocks)


def _f16(raw: np.ndarray) -> torch.Tensor:
    """[out, nb, 2] bytes -> [out, nb] float16."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0])


def _levels(q: np.ndarray) -> torch.Tensor:
    """[out, nb, ...] small ints -> [out, in] uint8."""
    return torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).reshape(q.shape[0], -1))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones (GGML's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(blocks: np.ndarray) -> GroupedWeight:
    q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128  # [out, nb, 32]
    return GroupedWeight(_levels(q), _f16(blocks[..., :2]), None, bits=8)


def _q4_0(blocks: np.ndarray) -> GroupedWeight:
    return GroupedWeight(_levels(_nibbles(blocks[..., 2:])), _f16(blocks[..., :2]), None, bits=4)


def _q4_1(blocks: np.ndarray) -> GroupedWeight:
    return GroupedWeight(_levels(_nibbles(blocks[..., 4:])), _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), bits=4)


def _five_bits(blocks: np.ndarray) -> np.ndarray:
    """[out, nb, 20] (4 bytes of high bits, 16 of nibbles) -> [out, nb, 32] q in 0..31: bit j of the
    little-endian 32-bit word is element j's fifth bit."""
    high = np.unpackbits(blocks[..., :4], axis=-1, bitorder="little")  # [out, nb, 32]
    q: np.ndarray = _nibbles(blocks[..., 4:]) | (high << 4)
    return q


def _q5_0(blocks: np.ndarray) -> GroupedWeight:
    q = _five_bits(blocks[..., 2:]).astype(np.int16) + 112  # level - 128 = q - 16
    return GroupedWeight(_levels(q), _f16(blocks[..., :2]), None, bits=8)


def _q5_1(blocks: np.ndarray) -> GroupedWeight:
    return GroupedWeight(_levels(_five_bits(blocks[..., 4:])), _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), bits=8)


def _q4_k(blocks: np.ndarray) -> GroupedWeight:
    out, nb, _ = blocks.shape
    d = _f16(blocks[..., 0:2]).float()[..., None]  # [out, nb, 1]
    dmin = _f16(blocks[..., 2:4]).float()[..., None]
    sc, m = GGUF_Q4_K.get_scale_min(blocks[..., 4:16].reshape(out * nb, 12))  # [out * nb, 8] 6-bit each
    scales = d * torch.from_numpy(sc.astype(np.float32)).view(out, nb, 8)  # gguf: d * sc in float32
    minimums = -(dmin * torch.from_numpy(m.astype(np.float32)).view(out, nb, 8))  # w = d sc q - dmin m
    # 128 bytes: sub-blocks 2i and 2i + 1 are the low and high nibbles of bytes 32i .. 32i + 31
    q = _nibbles(blocks[..., 16:].reshape(out, nb, 4, 32))  # [out, nb, 4, 64]
    return GroupedWeight(_levels(q), scales.reshape(out, -1), minimums.reshape(out, -1), bits=4)


def _q6_k(blocks: np.ndarray) -> GroupedWeight:
    out, nb, _ = blocks.shape
    ql = _nibbles(blocks[..., :128].reshape(out, nb, 2, 64))  # low 4 bits: [out, nb, 2, 128]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    qh = ((blocks[..., 128:192].reshape(out, nb, 2, 1, 32) >> shifts) & 0x03).reshape(out, nb, 2, 128)
    q6 = ql | (qh << 4)  # 0..63: the high 2 bits in the low bits' order
    sc = torch.from_numpy(blocks[..., 192:208].view(np.int8).astype(np.float32))  # [out, nb, 16]
    scales = _f16(blocks[..., 208:210]).float()[..., None] * sc  # gguf: d * sc in float32
    return GroupedWeight(_levels(q6.astype(np.int16) + 96), scales.reshape(out, -1), None, bits=8)


def join_rows(parts: list[GroupedWeight]) -> GroupedWeight:
    """Stack the parts of a fused layer (q, k, v or gate, up) along the output rows, as one weight
    (see common_format)."""
    widened = common_format(parts)
    minimums = [p.minimums for p in widened if p.minimums is not None]  # all of them, or none
    return GroupedWeight(
        torch.cat([p.levels for p in widened]),
        torch.cat([p.scales for p in widened]),
        torch.cat(minimums) if minimums else None,
        widened[0].bits,
    )


def common_format(parts: list[GroupedWeight]) -> list[GroupedWeight]:
    """The parts of a fused layer brought to the finest representation among them (the most bits,
    the smallest group, float32 params where any part has them, minimums where any part has them),
    so the fused layer stays one GEMM (llama.cpp's Q4_K_M files join Q4_K q/k with a Q6_K v). Every
    step is exact: each part still dequantizes to gguf's values (see _widen)."""
    bits = max(p.bits for p in parts)
    group = min(p.group_size for p in parts)
    dtype = torch.float32 if any(p.scales.dtype == torch.float32 for p in parts) else torch.float16
    with_minimums = any(p.minimums is not None for p in parts)
    return [_widen(p, bits, group, dtype, with_minimums) for p in parts]


def _widen(part: GroupedWeight, bits: int, group: int, dtype: torch.dtype, with_minimums: bool) -> GroupedWeight:
    levels, scales, minimums = part.levels, part.scales.to(dtype), part.minimums
    minimums = None if minimums is None else minimums.to(dtype)
    repeat = part.group_size // group
    scales = scales.repeat_interleave(repeat, dim=1)
    minimums = None if minimums is None else minimums.repeat_interleave(repeat, dim=1)
    offset = 1 << (part.bits - 1)
    if minimums is None and with_minimums:
        # s * (q - offset) = s * (q - low) + (-step * s) with step = offset - low the smallest power of
        # two that keeps q - low >= 0. Both terms are exact (s has at most 18 significant bits in any
        # GGUF type, q - low at most 8, 6 for Q6_K; step * s only moves the exponent, in float16 too),
        # so their float32 sum is gguf's one product, rounded once.
        gap = offset - (int(levels.min()) if levels.numel() else offset)
        step = 1 << max(0, gap - 1).bit_length()
        levels = levels - (offset - step)
        minimums = scales * -float(step)
    elif minimums is None and bits != part.bits:  # keep q - offset: the new offset is 2 ** (bits - 1)
        levels = (levels.to(torch.int16) + ((1 << (bits - 1)) - offset)).to(torch.uint8)
    return GroupedWeight(levels, scales, minimums, bits)
