"""What every tensor-parallel rank does before it loads its shard: take its own cores, join the group,
and seed its random number generator the same as every other rank."""

from __future__ import annotations

import os
import socket

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import init_tensor_parallel


def cores_for_rank(cores: list[int], rank: int, world_size: int) -> list[int]:
    """Rank r's contiguous share of `cores` (sorted); with fewer cores than ranks, ranks share them."""
    cores = sorted(cores)
    if len(cores) < world_size:
        return [cores[rank % len(cores)]]
    per_rank, extra = divmod(len(cores), world_size)
    start = rank * per_rank + min(rank, extra)
    return cores[start : start + per_rank + (rank < extra)]


def pin_to_cores(cores: list[int]) -> None:
    """Run this process, and torch's thread pool, on `cores` only: ranks on the same machine then never
    compete for a core (each GEMM's threads would otherwise wait on the slowest, preempted one)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (rank 0 hands it to the others)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def setup_rank(config: EngineConfig, rank: int, init_method: str, cores: list[int]) -> None:
    """Pin, then join the group (blocks until every rank has joined): rank // TP is its pipeline stage."""
    pin_to_cores(cores)
    parallel = config.parallel
    stages = parallel.stage_layers(config.model.hf_config)
    layers = stages if parallel.pipeline_parallel_size > 1 else None
    init_tensor_parallel(rank, parallel.world_size, init_method, config.device, stage_layers=layers)


def seed_rank(config: EngineConfig) -> None:
    """Every rank draws the same unseeded random samples from identical logits, so the ranks' request
    states stay in lockstep: seed the default generator the same everywhere, once the runners exist."""
    torch.manual_seed(config.model.seed)
