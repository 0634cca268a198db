"""Tensor-parallel size 1: today's ModelRunner, called directly in this process."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.config import EngineConfig
from tokenmill.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.worker.model_runner import ModelRunner


class UniprocExecutor:
    def __init__(
        self, config: EngineConfig, folder: Path | None, eos_token_ids: list[int], grammars: GrammarCompiler
    ) -> None:
        self.driver = ModelRunner(config, folder, eos_token_ids, grammars)

    @property
    def device(self) -> torch.device:
        return self.driver.device

    def kv_cache_bytes_per_block(self) -> int:
        return self.driver.kv_cache_bytes_per_block()

    def profile_run(self) -> None:
        self.driver.profile_run()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.driver.allocate_kv_cache(num_blocks)

    def capture_cuda_graphs(self) -> None:
        self.driver.capture_cuda_graphs()

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.execute(sched)

    @property
    def pipeline_depth(self) -> int:
        return 1  # one rank: no stages

    def launch(self, sched: SchedulerOutput) -> None:
        self.driver.launch(sched)

    def collect(self) -> ModelRunnerOutput:
        return self.driver.collect()

    def shutdown(self) -> None:
        pass
