"""This process's place in the tensor-parallel group.

One process per rank. Until `init_tensor_parallel` runs (and at tensor_parallel_size 1 it never does),
the group is rank 0 of 1: the sharded layers then hold whole weights and every collective is a no-op,
so TP=1 runs the same code as before tensor parallelism existed."""

from __future__ import annotations

import datetime
import gc
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective blocked on a dead peer fails after this long (gloo usually notices the closed socket sooner).
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    group: dist.ProcessGroup | None  # None at world size 1


_GROUP = TensorParallelGroup(0, 1, None)


def get_tp_group() -> TensorParallelGroup:
    return _GROUP


def tp_rank() -> int:
    return _GROUP.rank


def tp_world_size() -> int:
    return _GROUP.world_size


def backend_for(device: str) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def check_no_group() -> None:
    """Raise a ValueError if this process has joined a group already (one tensor-parallel engine per process)."""
    if dist.is_initialized():
        gc.collect()  # an engine nobody holds may be in a reference cycle: its finalizer leaves the group
    if dist.is_initialized():
        raise ValueError(
            "this process already runs a tensor-parallel engine: shut it down first (llm.shutdown(), or "
            "`with LLM(...) as llm:`); one tensor-parallel engine per process."
        )


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Join the group (every rank calls this with the same `init_method`, e.g. tcp://127.0.0.1:PORT)."""
    global _GROUP
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    if world_size == 1:
        _GROUP = TensorParallelGroup(0, 1, None)
        return
    check_no_group()
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _GROUP = TensorParallelGroup(rank, world_size, dist.group.WORLD)


def destroy_tensor_parallel() -> None:
    """Leave the group (safe to call twice, or when it was never joined)."""
    global _GROUP
    if _GROUP.group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TensorParallelGroup(0, 1, None)
