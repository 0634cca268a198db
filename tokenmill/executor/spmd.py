"""What the multi-rank executors share: rank 0 (this process) sends each command to the followers, then
runs it itself; every rank runs the same step on the same SchedulerOutput (SPMD).

The collectives inside the model keep the ranks together, and since the gathered logits and the
random generators are the same everywhere, every rank samples the same tokens: their request states
stay in lockstep and rank 0's output is the one returned. Once a rank dies or any rank's step raises,
the ranks are out of step for good: the executor raises ExecutorDeadError and the engine stops."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from tokenmill.executor.base import ExecutorDeadError
from tokenmill.executor.messages import (
    WORKER_COMMANDS,
    AllocateKVCache,
    CaptureCudaGraphs,
    CollectStep,
    ExecuteStep,
    LaunchStep,
    ProfileRun,
    WorkerCommand,
)
from tokenmill.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner

T = TypeVar("T")


class SpmdExecutor:
    """Subclasses start the followers and say how to reach them (`_broadcast`) and how to tell that one
    died (`_raise_if_dead`, `_wait_for_deaths`)."""

    driver: ModelRunner
    closed: bool = False

    @property
    def device(self) -> torch.device:
        return self.driver.device

    def kv_cache_bytes_per_block(self) -> int:
        return self.driver.kv_cache_bytes_per_block()

    def profile_run(self) -> None:
        self._send(ProfileRun())
        self._guarded(self.driver.profile_run)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._send(AllocateKVCache(num_blocks))
        self._guarded(lambda: self.driver.allocate_kv_cache(num_blocks))

    def capture_cuda_graphs(self) -> None:
        self._send(CaptureCudaGraphs())
        self._guarded(self.driver.capture_cuda_graphs)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._send(ExecuteStep(sched))
        output: ModelRunnerOutput = self._guarded(lambda: self.driver.execute(sched))
        return output

    @property
    def pipeline_depth(self) -> int:
        return self.driver.config.parallel.pipeline_parallel_size

    def launch(self, sched: SchedulerOutput) -> None:
        self._send(LaunchStep(sched))
        self._guarded(lambda: self.driver.launch(sched))

    def collect(self) -> ModelRunnerOutput:
        self._send(CollectStep())
        output: ModelRunnerOutput = self._guarded(self.driver.collect)
        return output

    def _send(self, command: WorkerCommand) -> None:
        if self.closed:
            raise ExecutorDeadError("the tensor-parallel executor was shut down")
        self._raise_if_dead()
        self._broadcast(WORKER_COMMANDS.encode(command))

    def _guarded(self, call: Callable[[], T]) -> T:
        """Rank 0's part of a command. If it raises, name a dead follower when there is one (its death
        is what usually breaks the collective), else rank 0's own error."""
        try:
            return call()
        except Exception as exc:
            self._wait_for_deaths()
            self._raise_if_dead()
            raise ExecutorDeadError(f"tensor-parallel rank 0 failed a step: {exc!r}") from exc

    def _broadcast(self, data: bytes) -> None:
        raise NotImplementedError

    def _raise_if_dead(self) -> None:
        """Raise ExecutorDeadError naming the first follower that is gone."""
        raise NotImplementedError

    def _wait_for_deaths(self) -> None:
        """Give a follower whose socket just closed the moment it takes to be seen as dead."""
        raise NotImplementedError
