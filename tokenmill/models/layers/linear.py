"""Linear layers whose weights arrive in pieces: fused QKV and fused gate/up projections.

Each layer has a `weight_loader(param, loaded, shard_id)` that copies one checkpoint tensor into
the right rows, so the model's `load_weights` is a simple name mapping. (The loader lives on the
module, not the parameter: moving a model off the meta device replaces its parameters.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.ops.cpu_ops import cpu_ops


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        default_weight_loader(param, loaded, shard_id)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.out_sizes = out_sizes

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] projection (the MLP's): [num_tokens, in] -> [num_tokens, out / 2].
        The packed layers that replace this one on CPU (tokenmill.quant) fuse it into their GEMM."""
        gate_up = self(x)  # [num_tokens, 2 * intermediate]
        ops = cpu_ops(gate_up)
        if ops is not None:
            return ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _shard_index(self, shard_id: str | int | None) -> int:
        if not isinstance(shard_id, int):
            raise ValueError(f"{type(self).__name__} needs an integer shard id, got {shard_id!r}")
        return shard_id

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        i = self._shard_index(shard_id)
        rows = param.data.narrow(0, self.offsets[i], self.out_sizes[i])
        if rows.shape != loaded.shape:
            raise ValueError(f"shard {shard_id} of shape {tuple(loaded.shape)} does not fit {tuple(rows.shape)}")
        rows.copy_(loaded)


class QKVLinear(MergedLinear):
    """q, k and v projections in one GEMM: output is [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=bias)

    def _shard_index(self, shard_id: str | int | None) -> int:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        return "qkv".index(shard_id)
