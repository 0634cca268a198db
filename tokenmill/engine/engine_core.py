"""The engine core: scheduler + KV cache manager + model runner, driven one step at a time.

One step = schedule() -> execute(SchedulerOutput) -> update_from_output(ModelRunnerOutput)."""

from __future__ import annotations

import logging

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.loader.model_loader import ModelSource
from tokenmill.outputs import EngineCoreOutput
from tokenmill.worker.model_runner import ModelRunner, kv_cache_bytes_per_block

logger = logging.getLogger(__name__)


def num_kv_blocks(config: EngineConfig) -> int:
    """An explicit count, else what the memory budget holds (never more than every sequence could use
    at full length: beyond that, blocks only serve as prefix cache, which the budget still bounds)."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    per_block = kv_cache_bytes_per_block(config)
    if config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        budget = free * config.cache.gpu_memory_utilization
    else:
        budget = config.cache.kv_cache_memory_gb * 2**30
    blocks_per_seq = -(-config.scheduler.max_model_len // config.cache.block_size)
    return max(1, min(int(budget // per_block), 2 * config.scheduler.max_num_seqs * blocks_per_seq))


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.runner = ModelRunner(config, source.folder, source.eos_token_ids)
        self.num_blocks = num_kv_blocks(config)
        self.runner.allocate_kv_cache(self.num_blocks)
        self.kv_cache = KVCacheManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.num_idle_steps = 0  # consecutive steps that scheduled nothing while requests waited
        self.num_failed_steps = 0  # model steps that raised (the server treats one as fatal)
        logger.info(
            "engine ready: %d KV blocks of %d tokens, dtype %s (weights %s), attention %s",
            self.num_blocks, config.cache.block_size, config.model.dtype,
            config.model.weight_dtype or config.model.dtype, self.runner.backend.name,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, req_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_request(req_id, status)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.num_idle_steps = self.num_idle_steps + 1 if self.has_unfinished() else 0
            if self.num_idle_steps > 2:  # cannot happen if admission checks hold; never hang on it
                return self._fail(list(self.scheduler.requests), "the scheduler could not place this request")
            if not sched.finished_req_ids:
                return []
        else:
            self.num_idle_steps = 0
        try:
            runner_out = self.runner.execute(sched)
        except Exception as exc:  # a failed forward ends the step's requests, never the engine
            self.num_failed_steps += 1
            logger.exception("model step failed; ending the %d requests in it", len(sched.num_scheduled_tokens))
            return self._fail(list(sched.num_scheduled_tokens), f"engine error during the model step: {exc!r}")
        return self.scheduler.update_from_output(sched, runner_out)

    def _fail(self, req_ids: list[str], message: str) -> list[EngineCoreOutput]:
        for req_id in req_ids:
            self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(r, [], finish_reason="error", error=message) for r in req_ids]
