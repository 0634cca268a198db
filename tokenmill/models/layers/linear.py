"""Linear layers whose weights arrive in pieces (fused QKV, fused gate/up) and split across
tensor-parallel ranks (Megatron-style).

Column-parallel layers (QKVLinear, MergedLinear) keep this rank's output rows; row-parallel ones
(RowParallelLinear) keep its input columns, and the caller sums their outputs over the ranks (the
model's forward does: tokenmill.quant swaps these modules for packed ones at load, so the all-reduce
cannot live inside them). Each layer has a `weight_loader(param, loaded, shard_id)` that copies this
rank's slice of one checkpoint tensor into the right rows, narrowing the (mmapped) tensor first, so a
rank never reads the others' slices. (The loader lives on the module, not the parameter: moving a
model off the meta device replaces its parameters.) At world size 1 every slice is the whole tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import tp_rank, tp_world_size
from tokenmill.ops.cpu_ops import cpu_ops
from tokenmill.ops.triton_ops import triton_ops


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) does not split evenly over {parts} tensor-parallel ranks")
    return total // parts


def _copy_slice(target: torch.Tensor, loaded: torch.Tensor, dim: int, start: int, shard_id: str | int | None) -> None:
    """target <- loaded[start : start + target.shape[dim]] along `dim`."""
    piece = loaded.narrow(dim, start, target.shape[dim]) if loaded.dim() > dim else loaded
    if piece.shape != target.shape:
        raise ValueError(f"shard {shard_id} of shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
    target.copy_(piece)


class Linear(nn.Linear):
    """A whole (replicated) weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        """No random init: every weight comes from the checkpoint (or loader/dummy.py), and an init on
        the meta device still runs torch's reference ops (the first one imports torch._dynamo)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        default_weight_loader(param, loaded, shard_id)


class RowParallelLinear(Linear):
    """y = x @ W.T with W's input columns split across the ranks: each rank holds [out, in / N] and
    multiplies its slice of x; the caller all-reduces the partial outputs. A bias is added on rank 0 only
    (the others hold zeros), so the sum carries it once."""

    row_parallel = True  # read by tokenmill.quant: int8 scales are taken over the whole row

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(divide(in_features, tp_world_size(), "the input size"), out_features, bias=bias)
        self.tp_rank = tp_rank()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        if param.dim() == 1:  # the bias
            if self.tp_rank == 0:
                default_weight_loader(param, loaded, shard_id)
            else:
                param.data.zero_()
            return
        _copy_slice(param.data, loaded, 1, self.tp_rank * self.in_features, shard_id)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (e.g. gate and up), each split
    across the ranks: a rank holds its slice of every projection, [gate_r | up_r]."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        n = tp_world_size()
        local = [divide(size, n, "a projection's output size") for size in out_sizes]
        super().__init__(in_features, sum(local), bias=bias)
        self.tp_rank = tp_rank()
        self.offsets = [sum(local[:i]) for i in range(len(local))]
        self.out_sizes = local

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] projection (the MLP's): [num_tokens, in] -> [num_tokens, out / 2].
        The packed layers that replace this one on CPU (tokenmill.quant) fuse it into their GEMM."""
        return silu_and_mul(self(x))

    def _shard_index(self, shard_id: str | int | None) -> int:
        if not isinstance(shard_id, int):
            raise ValueError(f"{type(self).__name__} needs an integer shard id, got {shard_id!r}")
        return shard_id

    def _source_start(self, i: int) -> int:
        """Where this rank's slice of projection i starts in the checkpoint tensor."""
        return self.tp_rank * self.out_sizes[i]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        i = self._shard_index(shard_id)
        rows = param.data.narrow(0, self.offsets[i], self.out_sizes[i])
        _copy_slice(rows, loaded, 0, self._source_start(i), shard_id)


class QKVLinear(MergedLinear):
    """q, k and v projections in one GEMM: output is [q (Hq*D) | k (Hkv*D) | v (Hkv*D)] of this rank's
    heads. Query heads split evenly; KV heads too, or, with more ranks than KV heads, each rank keeps the
    one KV head its query heads read (rank r of N: head r * Hkv // N)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        n, self.tp_rank = tp_world_size(), tp_rank()
        self.num_heads = divide(num_heads, n, "the number of attention heads")
        if n <= num_kv_heads:
            self.num_kv_heads = divide(num_kv_heads, n, "the number of KV heads")
            self.kv_head_start = self.tp_rank * self.num_kv_heads
        else:
            divide(n, num_kv_heads, "the ranks sharing each KV head")
            self.num_kv_heads = 1
            self.kv_head_start = self.tp_rank * num_kv_heads // n
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        Linear.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias=bias)  # sizes already per rank
        self.offsets = [0, self.q_size, self.q_size + self.kv_size]
        self.out_sizes = [self.q_size, self.kv_size, self.kv_size]

    def _shard_index(self, shard_id: str | int | None) -> int:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        return "qkv".index(shard_id)

    def _source_start(self, i: int) -> int:
        return self.tp_rank * self.q_size if i == 0 else self.kv_head_start * self.head_dim


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [num_tokens, 2 * n] [gate | up] output: [num_tokens, n]."""
    fused = triton_ops(gate_up)
    if fused is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return fused.silu_mul(gate_up)
    ops = cpu_ops(gate_up)
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
