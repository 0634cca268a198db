"""What the engine core asks of the model runner(s), wherever they run."""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner


class ExecutorDeadError(RuntimeError):
    """A rank died or failed a step: the ranks can no longer run in lockstep, so the engine must stop
    (and may be restarted)."""


class Executor(Protocol):
    """Runs one ModelRunner per tensor-parallel rank; `driver` is rank 0's, in this process, whose
    outputs are the ones returned."""

    driver: ModelRunner

    @property
    def device(self) -> torch.device: ...

    def kv_cache_bytes_per_block(self) -> int:
        """One rank's bytes per KV block (each rank caches its own KV heads)."""
        ...

    def profile_run(self) -> None:
        """The largest step on dummy tokens, on every rank (CUDA memory profiling)."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The same number of blocks on every rank (decided on rank 0)."""
        ...

    def capture_cuda_graphs(self) -> None: ...

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; rank 0's output."""
        ...

    @property
    def pipeline_depth(self) -> int:
        """Steps the engine may keep in flight: the pipeline stages (1 without them)."""
        ...

    def launch(self, sched: SchedulerOutput) -> None:
        """Start a step on every rank; `collect` takes its output later (pipeline stages, async scheduling)."""
        ...

    def collect(self) -> ModelRunnerOutput:
        """The oldest launched step's output (rank 0's)."""
        ...

    def shutdown(self) -> None:
        """Stop the other ranks (idempotent)."""
        ...
