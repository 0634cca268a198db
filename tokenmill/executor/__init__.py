"""Runs the model runner: in this process, or one process (or Ray actor) per rank (tensor-parallel ranks
of each pipeline stage)."""

from __future__ import annotations

from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor, ExecutorDeadError
from tokenmill.structured.compiler import GrammarCompiler


def make_executor(
    config: EngineConfig, folder: Path | None, eos_token_ids: list[int], grammars: GrammarCompiler
) -> Executor:
    """The executor config.parallel asks for; `grammars` is rank 0's grammar compiler."""
    parallel = config.parallel
    if parallel.world_size == 1:
        from tokenmill.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config, folder, eos_token_ids, grammars)
    if parallel.distributed_executor_backend == "ray":
        from tokenmill.executor.ray_executor import RayExecutor

        return RayExecutor(config, folder, eos_token_ids, grammars)
    from tokenmill.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, folder, eos_token_ids, grammars)


__all__ = ["Executor", "ExecutorDeadError", "make_executor"]
