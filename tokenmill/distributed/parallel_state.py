"""This process's place in the tensor-parallel group and the pipeline.

One process per rank. Until `init_tensor_parallel` runs (and at a world size of 1 it never does), the
group is rank 0 of 1 and the pipeline one stage: the sharded layers then hold whole weights, every
collective is a no-op, and TP=1 runs the same code as before tensor parallelism existed.

With pipeline stages, global rank g is stage g // TP's tensor-parallel rank g % TP: each stage's ranks
form their own tensor-parallel group, and rank r of a stage passes activations to rank r of the next."""

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


@dataclass(frozen=True)
class PipelineStage:
    stage: int
    num_stages: int
    rank: int  # this process's global rank
    tp_size: int  # ranks per stage: the next stage's rank r is rank + tp_size
    layers: tuple[int, int] | None  # this stage's decoder layers [start, end); None: every layer

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def last_stage_rank(self) -> int:
        """The global rank whose outputs every rank takes (the last stage's tensor-parallel rank 0)."""
        return (self.num_stages - 1) * self.tp_size


_STAGE = PipelineStage(0, 1, 0, 1, None)


def get_pp_stage() -> PipelineStage:
    return _STAGE


def pp_world_size() -> int:
    return _STAGE.num_stages


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
    rank: int,
    world_size: int,
    init_method: str,
    device: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stage_layers: list[tuple[int, int]] | None = None,
) -> None:
    """Join the group (every rank calls this with the same `init_method`, e.g. tcp://127.0.0.1:PORT).
    `stage_layers`: each pipeline stage's decoder layers (None: one stage); `world_size` counts the
    ranks of every stage."""
    global _GROUP, _STAGE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    num_stages = len(stage_layers) if stage_layers else 1
    if world_size % num_stages:
        raise ValueError(f"{world_size} ranks do not split into {num_stages} pipeline stages")
    tp_size = world_size // num_stages
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
    stage = rank // tp_size
    if num_stages == 1:
        _GROUP = TensorParallelGroup(rank, world_size, dist.group.WORLD)
        return
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(num_stages)]  # all ranks
    _GROUP = TensorParallelGroup(rank % tp_size, tp_size, groups[stage] if tp_size > 1 else None)
    _STAGE = PipelineStage(stage, num_stages, rank, tp_size, stage_layers[stage] if stage_layers else None)


def destroy_tensor_parallel() -> None:
    """Leave the group and the pipeline (safe to call twice, or when it was never joined)."""
    global _GROUP, _STAGE
    if (_GROUP.group is not None or _STAGE.num_stages > 1) and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TensorParallelGroup(0, 1, None)
    _STAGE = PipelineStage(0, 1, 0, 1, None)
