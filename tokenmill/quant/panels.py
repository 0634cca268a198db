"""The packed weight layouts of the C++ GEMM (ops/csrc/packed_gemm.h): panels of 16 output channels, k-major.

- float32 for AVX2: [P, K, 16], the 16 channels of each k in order (pack_f32).
- bf16 for AVX2: [P, K, 16], the 16 channels of each k interleaved [0, 8, 1, 9, ..., 7, 15], so the
  kernel splits one 32-byte load into channels 0-7 (the low halves of its 32-bit words) and 8-15
  (the high halves) with one shift and one mask.
- k pairs (int8 for AVX2, and bf16 for AVX-512 BF16): [P, K/2, 16, 2] stored as [P, K, 16]: each
  channel's weights for k and k+1 side by side, the operand order of the kernel's pair multiply-adds
  (vpmaddwd, vdpbf16ps). K is padded to even, for bf16 to whole groups of GROUP: 16 pair rows of a
  panel are then an AMX B tile as they lie (ops/csrc/packed_gemm_amx.h).
- int8 k quads for AVX-512 VNNI: [P, K/4, 16, 4] stored as [P, K, 16] (K padded to whole groups of
  GROUP), each channel's weights for k..k+3 side by side and offset by 128 (stored bits = w ^ 0x80):
  the unsigned operand of vpdpbusd.
- grouped 4-bit levels (every instruction set): the int8 quads' order, two quads a byte, [P, K, 8];
  8-bit levels: the int8 quads unshifted, [P, K, 16] uint8 (pack_grouped)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 16  # output channels per packed panel
GROUP = 32  # int8 quads: K is padded to whole activation groups (ops/csrc/packed_gemm_avx512.h kGroup)
# stored position -> channel, for bf16 panels
INTERLEAVE = torch.arange(PANEL).view(2, PANEL // 2).t().reshape(-1)


def _panels(w: torch.Tensor, in_padded: int) -> torch.Tensor:
    """[out, in] -> [P, 16, in_padded], zero rows and columns padding the last panel and K."""
    out_features, in_features = w.shape
    num_panels = -(-out_features // PANEL)
    padded = F.pad(w, (0, in_padded - in_features, 0, num_panels * PANEL - out_features))
    return padded.view(num_panels, PANEL, in_padded)


def pack_bf16(w: torch.Tensor, pairs: bool) -> torch.Tensor:
    """[out, in] bf16 -> [ceil(out / 16), in, 16] interleaved, or k pairs of whole groups (`pairs`, see
    pack_pairs)."""
    if pairs:
        return pack_pairs(w, GROUP)
    return _panels(w, w.shape[1])[:, INTERLEAVE].transpose(1, 2).contiguous()


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 -> [ceil(out / 16), in, 16], channels in order."""
    return _panels(w, w.shape[1]).transpose(1, 2).contiguous()


def unpack_bf16(packed: torch.Tensor, out_features: int, in_features: int, pairs: bool) -> torch.Tensor:
    if pairs:
        return unpack_pairs(packed, out_features, in_features)
    return packed[:, :, torch.argsort(INTERLEAVE)].transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]


def pack_pairs(w: torch.Tensor, multiple: int = 2) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in rounded up to `multiple` (even), 16] holding [P, K/2, 16, 2]."""
    in_padded = -(-w.shape[1] // multiple) * multiple
    panels = _panels(w, in_padded).view(-1, PANEL, in_padded // 2, 2)
    return panels.permute(0, 2, 1, 3).reshape(-1, in_padded, PANEL).contiguous()


def unpack_pairs(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    num_panels, in_padded, _ = packed.shape
    pairs = packed.view(num_panels, in_padded // 2, PANEL, 2).permute(0, 2, 1, 3)  # [P, 16, K/2, 2]
    return pairs.reshape(num_panels * PANEL, in_padded)[:out_features, :in_features]


def _quads(q: torch.Tensor, in_padded: int) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in_padded, 16] holding [P, K/4, 16, 4]: k quads, channel by channel."""
    panels = _panels(q, in_padded).view(-1, PANEL, in_padded // 4, 4)
    return panels.permute(0, 2, 1, 3).reshape(-1, in_padded, PANEL)


def _unquads(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    num_panels, in_padded, _ = packed.shape
    quads = packed.view(num_panels, in_padded // 4, PANEL, 4).permute(0, 2, 1, 3)  # [P, 16, K/4, 4]
    return quads.reshape(num_panels * PANEL, in_padded)[:out_features]


def pack_quads(q: torch.Tensor) -> torch.Tensor:
    """[out, in] int8 -> [ceil(out / 16), in rounded up to GROUP, 16] int8 holding [P, K/4, 16, 4] of w + 128."""
    quads = _quads(q, -(-q.shape[1] // GROUP) * GROUP)
    return (quads.view(torch.uint8) ^ 0x80).view(torch.int8).contiguous()


def unpack_quads(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    return _unquads((packed.view(torch.uint8) ^ 0x80).view(torch.int8), out_features)[:, :in_features]


def pack_int8(q: torch.Tensor, quads: bool) -> torch.Tensor:
    """The int8 panels the built kernel reads: k quads (AVX-512 VNNI) or k pairs."""
    return pack_quads(q) if quads else pack_pairs(q)


def unpack_int8(packed: torch.Tensor, out_features: int, in_features: int, quads: bool) -> torch.Tensor:
    return (unpack_quads if quads else unpack_pairs)(packed, out_features, in_features)


def pack_grouped(
    levels: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A grouped weight (quant/grouped.py: levels [out, KP], KP a multiple of 32, scales and minimums
    [out, G]) -> (packed, params), the layout of the grouped GEMM (ops/csrc/packed_int4.h):
    - 4 bits: [P, KP, 8] uint8; per panel and group of 32 k, four 64-byte lines, line j holding each
      channel's levels for k 4j..4j+3 (low nibbles) and 16+4j..16+4j+3 (high nibbles), channel by
      channel: the int8 k quads' order with two quads a byte;
    - 8 bits: [P, KP, 16] uint8, the int8 k quads (pack_quads) of the levels as they are.
    params [P, G, 16], or [P, G, 2, 16] with minimums, in the scales' dtype: each group's 16 scales,
    then its 16 minimums."""
    out_features, in_padded = levels.shape
    pad = (-out_features) % PANEL
    num_panels = (out_features + pad) // PANEL
    if bits == 8:
        packed = _quads(levels, in_padded).contiguous()
    else:
        # [P, 16, A, half, j, i]: k = 32 a + 16 half + 4 j + i
        q = F.pad(levels, (0, 0, 0, pad)).view(num_panels, PANEL, in_padded // 32, 2, 4, 4)
        lines = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [P, 16, A, j, i]
        packed = lines.permute(0, 2, 3, 1, 4).reshape(num_panels, in_padded, PANEL // 2).contiguous()

    def per_panel(t: torch.Tensor) -> torch.Tensor:  # [out, G] -> [P, G, 16]
        return F.pad(t, (0, 0, 0, pad)).view(num_panels, PANEL, -1).transpose(1, 2)

    params = per_panel(scales) if minimums is None else torch.stack([per_panel(scales), per_panel(minimums)], dim=2)
    return packed, params.contiguous()


def unpack_grouped(
    packed: torch.Tensor, params: torch.Tensor, out_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """pack_grouped's inverse: (levels, scales, minimums or None, bits); the bits are the packed
    width's (8 bytes per k: 4 bits, 16: 8 bits)."""
    num_panels, in_padded, width = packed.shape
    if width == PANEL:
        levels, bits = _unquads(packed, out_features), 8
    else:
        lines = packed.view(num_panels, in_padded // 32, 4, PANEL, 4).permute(0, 3, 1, 2, 4)  # [P, 16, A, j, i]
        q = torch.stack([lines & 0x0F, lines >> 4], dim=3)  # [P, 16, A, half, j, i]
        levels, bits = q.reshape(num_panels * PANEL, in_padded)[:out_features], 4

    def per_channel(t: torch.Tensor) -> torch.Tensor:  # [P, G, 16] -> [out, G]
        return t.transpose(1, 2).reshape(num_panels * PANEL, -1)[:out_features]

    if params.dim() == 4:
        return levels, per_channel(params[:, :, 0]), per_channel(params[:, :, 1]), bits
    return levels, per_channel(params), None, bits
