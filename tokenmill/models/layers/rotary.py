"""Rotary position embedding (rotate-half layout, as HF Llama), with linear, llama3, YaRN and LongRoPE
scaling and partial rotary (only the first `partial_rotary_factor` of each head rotated, as Phi-4-mini).

LongRoPE's rule: HF picks the short or the long factors for a whole forward by its longest position, so a
key cached under the short factors would be read with the long ones once the sequence grows past
`original_max_position_embeddings`. Here the table is fixed per position instead: positions below the
original length use the short factors (exactly HF's numbers there), positions from it on the long ones.
A key's rotation then depends on its position alone, so cached keys stay valid and prefixes shareable."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill.ops.cpu_ops import cpu_ops


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """One dict with rope_theta and the scaling settings, from either transformers' v5 layout
    (`rope_parameters`) or the older `rope_theta` + `rope_scaling`; the config-level fields the scaled
    types read (partial_rotary_factor, original/max position embeddings) are copied in."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    if params["rope_type"] == "su":  # Phi-3's old name
        params["rope_type"] = "longrope"
    params.setdefault("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    max_position = getattr(hf_config, "max_position_embeddings", None)
    # Phi-3 keeps the pretraining length beside the rope settings, and it wins there (as in HF).
    original = getattr(hf_config, "original_max_position_embeddings", None)
    if original is not None and params["rope_type"] in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = original
    elif max_position is not None:
        params.setdefault("original_max_position_embeddings", max_position)
    if max_position is not None:
        params.setdefault("max_position_embeddings", max_position)
    return params


def rotary_dim_of(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading dims of each head rotate."""
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def _base_inv_freq(dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim / 2]


def _inv_freq(dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], the factor cos and sin are scaled by) for every position;
    LongRoPE, whose frequencies depend on the position, is handled by RotaryEmbedding."""
    inv_freq = _base_inv_freq(dim, params)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, params)
    raise ValueError(f"rope type {rope_type!r} is not supported (default, linear, llama3, yarn and longrope are).")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    # Dims that turn fewer than beta_slow times over the original length are interpolated (slowed by
    # `factor`), those that turn more than beta_fast times kept, a linear ramp between.
    base = float(params["rope_theta"])
    old_len = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else float(params["max_position_embeddings"]) / old_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim / 2]
    keep = 1 - ramp  # the share of the original frequency
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    # 1 / (factor * pos_freqs), not inv_freq / factor: the same rounding as transformers
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep, float(attention_factor)


def _longrope_tables(dim: int, positions: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Angles [max_position, dim / 2]: short factors below the original length, long from it on."""
    old_len = int(params["original_max_position_embeddings"])
    inv_freq = _base_inv_freq(dim, params)
    short = inv_freq / torch.tensor(params["short_factor"], dtype=torch.float32)
    long = inv_freq / torch.tensor(params["long_factor"], dtype=torch.float32)
    freqs = torch.outer(positions, short)
    freqs[old_len:] = torch.outer(positions[old_len:], long)
    return freqs


def _longrope_attention_factor(params: dict[str, Any]) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    old_len = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else float(params["max_position_embeddings"]) / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.params = head_dim, max_position, params
        self.rotary_dim = rotary_dim_of(head_dim, params)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute the tables in fp32 on the CPU, then move them to `device`; called again after a
        model built on 'meta' is materialised. On the CPU even inside a meta-device context: torch's
        meta arange runs its Python reference, whose first call imports torch._dynamo."""
        with torch.device("cpu"):
            t = torch.arange(self.max_position, dtype=torch.float32)
            if self.params["rope_type"] == "longrope":
                freqs = _longrope_tables(self.rotary_dim, t, self.params)  # [max_position, rotary_dim / 2]
                scale = _longrope_attention_factor(self.params)
            else:
                inv_freq, scale = _inv_freq(self.rotary_dim, self.params)  # [rotary_dim / 2]
                freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
        self.cos = (freqs.cos() * scale).to(device)
        self.sin = (freqs.sin() * scale).to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [num_tokens, 1, rotary_dim / 2]; computed once per step, used by
        every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(
    rotary: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, Hq, D], k: [num_tokens, Hkv, D] (views of the fused QKV output may be passed).
    The first 2 * cos.shape[-1] dims of each head rotate, the rest pass through. On CPU in float32 with
    the whole head rotating the C++ kernel rotates them in place, reading the rows where they lie;
    elsewhere new tensors are returned."""
    cos, sin = rotary
    head_dim = q.shape[-1]
    ops = cpu_ops(q) if 2 * cos.shape[-1] == head_dim else None  # the kernel rotates whole heads
    if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
        n, num_heads = q.shape[0], q.shape[1]
        ops.rotary_(q.view(n, num_heads * head_dim), num_heads, head_dim, cos, sin)
        ops.rotary_(k.view(n, k.shape[1] * head_dim), k.shape[1], head_dim, cos, sin)
        return q, k
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)
