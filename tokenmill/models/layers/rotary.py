"""Rotary position embedding (rotate-half layout, as HF Llama), with linear and llama3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill.ops.cpu_ops import cpu_ops


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """One dict with rope_theta and the scaling settings, from either transformers' v5 layout
    (`rope_parameters`) or the older `rope_theta` + `rope_scaling`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"rope type {rope_type!r} is not supported (default, linear and llama3 are).")


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


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.params = head_dim, max_position, params
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute the tables in fp32; called again after a model built on 'meta' is materialised."""
        inv_freq = _inv_freq(self.head_dim, self.params)  # [head_dim / 2]
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [num_tokens, 1, D / 2]; computed once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(
    rotary: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, Hq, D], k: [num_tokens, Hkv, D] (views of the fused QKV output may be passed).
    On CPU in float32 the C++ kernel rotates them in place, reading the rows where they lie; elsewhere
    new tensors are returned."""
    cos, sin = rotary
    ops = cpu_ops(q)
    if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
        n, num_heads, head_dim = q.shape
        ops.rotary_(q.view(n, num_heads * head_dim), num_heads, head_dim, cos, sin)
        ops.rotary_(k.view(n, k.shape[1] * head_dim), k.shape[1], head_dim, cos, sin)
        return q, k
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
