"""The mixture-of-experts block: a router that picks k experts per token, the experts, and (Qwen2-MoE)
a shared expert every token goes through, scaled by a sigmoid gate.

    routing = router.route(x)                             # ids [T, k] int64, weights [T, k] float32
    out = experts(x, routing.ids, routing.weights)        # sum over the k experts of weight * expert(x)
    out += sigmoid(shared_expert_gate(x)) * shared_expert(x)

The experts are one module holding every expert's weights stacked (`FusedExperts`: w13 [E, 2 * I, H],
w2 [E, H, I]), so one grouped GEMM runs them all; on CPU tokenmill.quant swaps it for packed or
quantized experts after the weights load (the same forward signature). Under tensor parallelism each
expert's intermediate dim is split like the dense MLP's (gate/up rows column-parallel, down columns
row-parallel), the router and the shared-expert gate are replicated, and the block all-reduces once.

The router and the shared-expert gate are not nn.Linear on purpose: quantization swaps every nn.Linear,
and a routing decision must not move with the weight precision of a [E, H] matrix that costs nothing."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.communication import all_reduce_
from tokenmill.distributed.parallel_state import tp_rank, tp_world_size
from tokenmill.models.layers.linear import MergedLinear, RowParallelLinear, divide


class Routing(NamedTuple):
    ids: torch.Tensor  # [num_tokens, k] int64, the chosen experts
    weights: torch.Tensor  # [num_tokens, k] float32, their weights


class ReplicatedGate(nn.Module):
    """x @ weight.T with the whole weight on every rank, kept in the model's float dtype (never quantized)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TopKRouter(ReplicatedGate):
    """Logits over the experts, then top-k, with the model's normalization (as HF computes it):
    - softmax then top-k ("softmax_topk"; Qwen2/3-MoE, Mixtral), the k probabilities renormalized to sum
      to 1 when `renormalize` (Qwen's norm_topk_prob; always for Mixtral);
    - top-k logits then softmax over those k ("topk_softmax"; GraniteMoe).
    `round_weights`: the weights are rounded to the activations' dtype (Qwen, Granite cast them back;
    Mixtral keeps float32), so a bf16 model weighs its experts as HF's does."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, scoring: str, renormalize: bool, round_weights: bool
    ) -> None:
        super().__init__(hidden_size, num_experts)
        if scoring not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown router scoring {scoring!r}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be from 1 to the number of experts ({num_experts})")
        self.top_k = top_k
        self.scoring = scoring
        self.renormalize = renormalize
        self.round_weights = round_weights

    def route(self, x: torch.Tensor) -> Routing:  # x: [num_tokens, hidden]
        logits = self(x)  # [num_tokens, E] in the model's dtype
        if self.scoring == "softmax_topk":
            probs = torch.softmax(logits.float(), dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [num_tokens, k]
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            top_logits, ids = torch.topk(logits.float(), self.top_k, dim=-1)
            weights = torch.softmax(top_logits, dim=-1)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        return Routing(ids, weights)


class FusedExperts(nn.Module):
    """Every expert's SiLU-gated MLP, stacked: w13 [E, 2 * I_local, H] (each expert's gate rows, then its up
    rows) and w2 [E, H, I_local], I_local being this tensor-parallel rank's slice of the intermediate dim.

    forward(x [T, H], topk_ids [T, k], topk_weights [T, k]) = sum over the k chosen experts of
    weight * down(silu(gate(x)) * up(x)): under tensor parallelism a partial sum the caller all-reduces.
    This torch forward is the reference and the GPU path: the T * k (token, expert) rows sorted by expert,
    two grouped GEMMs over the experts' row ranges, a weighted scatter-add back. No host sync where the
    grouped GEMM has a native kernel (bf16 on Hopper or Blackwell); elsewhere torch's grouped GEMM reads
    the offsets on the host, so a CUDA graph being captured runs every expert on every token instead."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = divide(intermediate_size, tp_world_size(), "the experts' intermediate size")
        self.tp_rank = tp_rank()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size))

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, k] int64
        topk_weights: torch.Tensor,  # [T, k] float32
    ) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing() and not _native_grouped_gemm(x):
            return self.forward_every_expert(x, topk_ids, topk_weights)
        num_tokens, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)  # [T * k]
        order = flat_ids.argsort(stable=True)  # the (token, expert) rows grouped by expert
        rows_per_expert = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        rows_per_expert.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offsets = rows_per_expert.cumsum(0, dtype=torch.int32)  # [E] each expert's end row
        token_of_row = order // k  # [T * k]
        rows = x[token_of_row]  # [T * k, H]
        gate_up = F.grouped_mm(rows, self.w13.transpose(1, 2), offs=offsets)  # [T * k, 2 * I_local]
        gate, up = gate_up.chunk(2, dim=-1)
        down = F.grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offsets)  # [T * k, H]
        weighted = down.float() * topk_weights.reshape(-1)[order].unsqueeze(-1)  # [T * k, H]
        out = torch.zeros(num_tokens, self.hidden_size, dtype=torch.float32, device=x.device)
        return out.index_add_(0, token_of_row, weighted).to(x.dtype)  # [T, H]

    def forward_every_expert(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, k] int64
        topk_weights: torch.Tensor,  # [T, k] float32
    ) -> torch.Tensor:
        """The same sum with every expert run on every token and weighted 0 where not chosen: E / k times
        the FLOPs, but no shape depends on the routing (decode batches under a CUDA graph)."""
        gate_up = torch.matmul(x.unsqueeze(0), self.w13.transpose(1, 2))  # [E, T, 2 * I_local]
        gate, up = gate_up.chunk(2, dim=-1)
        down = torch.bmm(F.silu(gate) * up, self.w2.transpose(1, 2))  # [E, T, H]
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=torch.float32, device=x.device)
        dense.scatter_add_(1, topk_ids, topk_weights)  # [T, E] each token's weight per expert
        return torch.einsum("eth,te->th", down.float(), dense).to(x.dtype)  # [T, H]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None, expert_id: int | None = None
    ) -> None:
        """Copy this rank's slice of one checkpoint tensor. With `expert_id`, one expert's tensor: shard_id
        "gate" or "up" ([I, H], into w13) or "down" ([H, I], into w2). Without, every expert's stacked:
        "gate_up" ([E, 2 * I, H], gate rows then up rows), "gate" or "up" ([E, I, H], GGUF's layout), or
        "down" ([E, H, I])."""
        if shard_id not in ("gate", "up", "down", "gate_up"):
            raise ValueError(f"expert shard id must be 'gate', 'up', 'down' or 'gate_up', got {shard_id!r}")
        i_local = self.intermediate_size
        start = self.tp_rank * i_local  # this rank's first intermediate row (or column) in the checkpoint
        if expert_id is not None:
            if not 0 <= expert_id < self.num_experts:
                raise ValueError(f"expert {expert_id} does not exist: this layer has {self.num_experts} experts")
            loaded = loaded.unsqueeze(0)  # as if stacked: [1, ...]
            target = param.data.narrow(0, expert_id, 1)
        elif loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
            raise ValueError(f"stacked expert tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        else:
            target = param.data
        if shard_id == "down":
            _copy(target, loaded.narrow(2, start, i_local))
            return
        # (where the piece starts in `loaded`, where it goes in w13): gate rows first, then up rows
        pieces = {"gate": [(0, 0)], "up": [(0, i_local)], "gate_up": [(0, 0), (loaded.shape[1] // 2, i_local)]}
        for source_row, target_row in pieces[shard_id]:
            _copy(target.narrow(1, target_row, i_local), loaded.narrow(1, source_row + start, i_local))


def _native_grouped_gemm(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs on the device without reading its offsets on the host."""
    return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] in (9, 10)


def _copy(target: torch.Tensor, piece: torch.Tensor) -> None:
    if piece.shape != target.shape:
        raise ValueError(f"expert weight of shape {tuple(piece.shape)} does not fit {tuple(target.shape)}")
    target.copy_(piece)


class ExpertMLP(nn.Module):
    """One SiLU-gated MLP (the shared expert) without the all-reduce: the MoE block sums it in with the
    routed experts' partial output and all-reduces once."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H], partial under TP
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class SparseMoeBlock(nn.Module):
    """Router, routed experts and an optional gated shared expert; one all-reduce under TP."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        router: TopKRouter,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.gate = router
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = ExpertMLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = ReplicatedGate(hidden_size, 1) if shared_intermediate_size else None
        self.tensor_parallel = tp_world_size() > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routing = self.gate.route(x)
        out = self.experts(x, routing.ids, routing.weights)  # [T, H], partial under TP
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # the gate is replicated, so scaling each rank's partial output scales the sum
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce_(out) if self.tensor_parallel else out
