"""The sharding math of the tensor-parallel layers, one simulated rank at a time (no processes: the
group is set to rank r of N, and the test sums or joins the ranks' results where the collectives would).
Reference: the same layer at world size 1, holding the whole weight."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from torch import nn

from tokenmill.distributed import parallel_state
from tokenmill.distributed.parallel_state import TensorParallelGroup
from tokenmill.executor.messages import WORKER_COMMANDS, ExecuteStep
from tokenmill.executor.rank_setup import cores_for_rank
from tokenmill.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from tokenmill.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams, params_for_wire

T = TypeVar("T")
D = 4  # head_dim


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int, build: Callable[[], T]) -> T:
    """`build()` run as rank `rank` of `world_size` (collectives stay no-ops: there is no group)."""
    monkeypatch.setattr(parallel_state, "_GROUP", TensorParallelGroup(rank, world_size, None))
    try:
        return build()
    finally:
        monkeypatch.setattr(parallel_state, "_GROUP", TensorParallelGroup(0, 1, None))


def loaded(layer: nn.Linear, pieces: dict[str | int | None, torch.Tensor]) -> nn.Linear:
    for shard_id, tensor in pieces.items():
        layer.weight_loader(layer.weight, tensor, shard_id)  # type: ignore[operator]
    return layer


def rows(n: int, width: int = 3, start: int = 0) -> torch.Tensor:
    """[n, width] rows numbered start, start + 1, ... (row i is filled with its number)."""
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, width).clone()


def test_qkv_splits_query_and_kv_heads_evenly(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = rows(4 * D), rows(2 * D, start=100), rows(2 * D, start=200)  # 4 query heads, 2 KV heads
    layer = as_rank(monkeypatch, 1, 2, lambda: QKVLinear(3, D, 4, 2, bias=False))
    loaded(layer, {"q": q, "k": k, "v": v})
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    assert torch.equal(layer.weight, torch.cat([q[2 * D :], k[D:], v[D:]]))  # heads 2-3 and KV head 1


@pytest.mark.parametrize(("rank", "kv_head"), [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_qkv_with_more_ranks_than_kv_heads_keeps_the_kv_head_its_query_heads_read(
    monkeypatch: pytest.MonkeyPatch, rank: int, kv_head: int
) -> None:
    # 8 query heads on 2 KV heads: query heads 0-3 read KV head 0. Rank r holds query heads 2r, 2r + 1.
    q, k, v = rows(8 * D), rows(2 * D, start=100), rows(2 * D, start=200)
    layer = as_rank(monkeypatch, rank, 4, lambda: QKVLinear(3, D, 8, 2, bias=False))
    loaded(layer, {"q": q, "k": k, "v": v})
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    kv = slice(kv_head * D, (kv_head + 1) * D)
    assert torch.equal(layer.weight, torch.cat([q[2 * rank * D : 2 * (rank + 1) * D], k[kv], v[kv]]))


def test_gate_up_keeps_its_slice_of_each_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    gate, up = rows(8), rows(8, start=100)
    layer = as_rank(monkeypatch, 1, 2, lambda: MergedLinear(3, [8, 8]))
    loaded(layer, {0: gate, 1: up})
    assert layer.out_sizes == [4, 4]
    assert torch.equal(layer.weight, torch.cat([gate[4:], up[4:]]))


def test_row_parallel_outputs_sum_to_the_whole_layer_with_the_bias_once(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    whole = loaded(RowParallelLinear(8, 5, bias=True), {None: weight})
    whole.weight_loader(whole.bias, bias, None)
    partial = []
    for rank in range(2):
        layer = as_rank(monkeypatch, rank, 2, lambda: RowParallelLinear(8, 5, bias=True))
        loaded(layer, {None: weight})
        layer.weight_loader(layer.bias, bias, None)
        assert layer.weight.shape == (5, 4)
        partial.append(layer(x[:, 4 * rank : 4 * (rank + 1)]))
    assert torch.allclose(partial[0] + partial[1], whole(x), atol=1e-6)
    assert torch.equal(layer.bias, torch.zeros(5))  # rank 1 holds no bias


def test_the_vocabulary_pads_to_a_multiple_of_the_ranks_and_lookups_sum_to_the_whole_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = rows(5, width=2, start=1)  # 5 tokens over 2 ranks: 3 rows each, one of them padding
    ids = torch.tensor([0, 4, 2, 3])
    total = torch.zeros(4, 2)
    for rank in range(2):
        emb = as_rank(monkeypatch, rank, 2, lambda: VocabParallelEmbedding(5, 2))
        emb.weight_loader(emb.weight, table, None)
        total += emb(ids)  # the all-reduce (a no-op here: no group): other ranks' tokens are zero rows
    assert torch.equal(emb.weight.data, torch.tensor([[4.0, 4.0], [5.0, 5.0], [0.0, 0.0]]))  # rank 1, padded
    assert torch.equal(total, table[ids])


def test_lm_head_shards_join_into_the_whole_logits_with_the_padding_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    weight, hidden = torch.randn(5, 3), torch.randn(2, 3)
    shards = []
    for rank in range(2):
        head = as_rank(monkeypatch, rank, 2, lambda: ParallelLMHead(3, 5))
        head.weight_loader(head.weight, weight, None)
        shards.append(head(hidden))  # [2, 3] each
    assert torch.allclose(torch.cat(shards, dim=-1)[:, :5], hidden @ weight.T, atol=1e-6)


@pytest.mark.parametrize(
    ("cores", "world_size", "expected"),
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
        ([3], 2, [[3], [3]]),  # fewer cores than ranks: they share
    ],
)
def test_each_rank_gets_its_own_contiguous_cores(cores: list[int], world_size: int, expected: list[list[int]]) -> None:
    assert [cores_for_rank(cores, r, world_size) for r in range(world_size)] == expected


def test_a_step_message_round_trips_through_msgpack() -> None:
    # As EngineCore.add_request hands them on: a dict schema as its text (integers past 64 bits).
    params = params_for_wire(
        SamplingParams(
            temperature=0.7,
            seed=3,
            logit_bias={5: -1.0},
            stop=["x"],
            structured_outputs=StructuredOutputsParams(json={"type": "integer", "maximum": 2**70}),
        )
    )
    sched = SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2, 3], [4], params, [0, 1], 2)],
        cached_requests=[CachedRequestData("b", [7], 33)],
        num_scheduled_tokens={"b": 3, "a": 2},  # row order is the batch's: kept
        total_num_scheduled_tokens=5,
        finished_req_ids={"c", "d"},
        scheduled_spec_tokens={"b": [9, 8]},
    )
    decoded = WORKER_COMMANDS.decode(WORKER_COMMANDS.encode(ExecuteStep(sched)))
    assert decoded == ExecuteStep(sched)
    assert isinstance(decoded, ExecuteStep) and list(decoded.sched.num_scheduled_tokens) == ["b", "a"]
