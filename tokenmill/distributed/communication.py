"""The collectives the sharded layers call (no-ops at world size 1), and what pipeline stages pass each
other: activations to the next stage, and the last stage's step output to every rank.

Each call is counted and timed (`COLLECTIVE_STATS`) so benchmarks can say what the all-reduces cost
per step; the clock is read only when there is a collective to run."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenmill.distributed.parallel_state import get_pp_stage, get_tp_group


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


def send_to_next_stage(tensors: list[torch.Tensor]) -> list[tuple[dist.Work, torch.Tensor]]:
    """Pass this stage's activations to the same tensor-parallel rank of the next stage, without waiting
    for the next stage to take them (it may still be busy with an earlier step). Returns each send's
    work and the tensor it reads: keep them until the works are waited on."""
    pp = get_pp_stage()
    sends = []
    for x in tensors:
        start = time.perf_counter()
        x = x.contiguous()
        work = dist.isend(x, pp.rank + pp.tp_size)
        if work is not None:  # None only on a rank outside the default group
            sends.append((work, x))
        _count(start, x)
    return sends


def recv_from_prev_stage(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The previous stage's activations, as send_to_next_stage sent them (shapes and dtype known)."""
    pp = get_pp_stage()
    out = []
    for shape in shapes:
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, pp.rank - pp.tp_size)
        out.append(x)
    return out


def send_output_from_last_stage(data: bytes) -> list[tuple[dist.Work, torch.Tensor]]:
    """The last stage's step output (`data`, encoded) from its tensor-parallel rank 0 to every other
    rank: a length, then the bytes, without waiting for them to be taken (each rank takes a step's
    output when it finishes that step, after it may have started the next). Returns the sends' works
    and tensors: keep them until the works are waited on."""
    pp = get_pp_stage()
    device = _wire_device()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    sends = []
    for rank in range(dist.get_world_size()):
        for x in (size, payload) if rank != pp.rank else ():
            work = dist.isend(x, rank)
            if work is not None:
                sends.append((work, x))
    return sends


def recv_output_of_last_stage() -> bytes:
    """The bytes send_output_from_last_stage sent this rank, for its oldest step not yet taken."""
    device = _wire_device()
    src = get_pp_stage().last_stage_rank
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(buffer, src)
    return bytes(buffer.cpu().numpy().tobytes())


def _wire_device() -> torch.device | None:
    """Where step outputs travel: gloo carries CPU tensors; NCCL, tensors on the rank's GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
