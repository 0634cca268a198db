"""The collectives the sharded layers call; no-ops at world size 1.

Each call is counted and timed (`COLLECTIVE_STATS`) so benchmarks can say what the all-reduces cost
per step; the clock is read only when there is a collective to run."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenmill.distributed.parallel_state import get_tp_group


@dataclass
class CollectiveStats:
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0


COLLECTIVE_STATS = CollectiveStats()


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns `x`."""
    tp = get_tp_group()
    if tp.group is None:
        return x
    start = time.perf_counter()
    dist.all_reduce(x, group=tp.group)
    _count(start, x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """[..., d] on each rank -> [..., world_size * d], rank 0's columns first."""
    tp = get_tp_group()
    if tp.group is None:
        return x
    start = time.perf_counter()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x, group=tp.group)
    _count(start, x)
    return torch.cat(parts, dim=-1)


def all_reduce_max_(x: torch.Tensor) -> torch.Tensor:
    """Element-wise max over the ranks, in place (load time: whole-row int8 scales of a row-split weight)."""
    tp = get_tp_group()
    if tp.group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp.group)
    return x


def _count(start: float, x: torch.Tensor) -> None:
    COLLECTIVE_STATS.calls += 1
    COLLECTIVE_STATS.seconds += time.perf_counter() - start
    COLLECTIVE_STATS.bytes += x.numel() * x.element_size()
