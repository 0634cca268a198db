"""Iteration-level scheduler: each step hands out a token budget so that every request's
`num_computed_tokens` catches up with its `num_tokens`. Running requests first, then waiting ones;
prefill chunks and decodes share one batch; blocks running out preempt by recompute."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import make_queue
from tokenmill.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    # Summed over steps, for the KV-slot utilisation (real tokens / allocated slots).
    kv_slots_used: int = 0
    kv_slots_allocated: int = 0

    @property
    def kv_slot_utilization(self) -> float:
        return self.kv_slots_used / self.kv_slots_allocated if self.kv_slots_allocated else 0.0


@dataclass(frozen=True)
class AdmissionLimits:
    """What any request must fit: plain numbers, so a front end in another process can check them."""

    max_model_len: int
    block_size: int
    num_blocks: int

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject at once what could never run, so nothing waits forever."""
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty; give at least one token.")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len}); shorten the prompt or lower max_tokens."
            )
        blocks = -(-total // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks but the cache has only {self.num_blocks}; "
                "shorten it or give the KV cache more memory."
            )


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._ended_since_last_step: set[str] = set()

    # ------------------------------------------------------------------ requests in and out
    @property
    def limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.config.max_model_len, self.kv_cache.block_size, self.kv_cache.num_blocks)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.limits.check(num_prompt_tokens, max_tokens)

    def add_request(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use.")
        self.requests[request.req_id] = request
        self.waiting.add(request)

    def finish_request(self, req_id: str, status: RequestStatus) -> None:
        """End a request (abort, stop string, error) wherever it is; frees its blocks at once."""
        request = self.requests.pop(req_id, None)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.finished_time = time.monotonic()
        self.kv_cache.free(request)
        self._ended_since_last_step.add(req_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        ended = self._ended_since_last_step
        self._ended_since_last_step = set()

        budget, preempted = self._schedule_running(budget, num_scheduled, cached_reqs, ended)
        if not preempted:
            self._schedule_waiting(budget, num_scheduled, new_reqs)

        total = sum(num_scheduled.values())
        self._record_step(num_scheduled, total)
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled, total, ended)

    def _victim_key(self, request: Request) -> tuple[int, float]:
        priority = request.priority if self.config.policy == "priority" else 0
        return (priority, request.arrival_time)

    def _schedule_running(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        cached_reqs: list[CachedRequestData],
        ended: set[str],
    ) -> tuple[int, bool]:
        # Most important first, so the victims (taken from the tail) are the least important.
        self.running.sort(key=self._victim_key)
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim, ended)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            num_scheduled[request.req_id] = num_new
            cached_reqs.append(CachedRequestData(request.req_id, new_block_ids, request.num_computed_tokens))
            budget -= num_new
            i += 1
        return budget, preempted

    def _preempt(self, request: Request, ended: set[str]) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(request)
        ended.add(request.req_id)  # the runner drops its state; it comes back as a new request
        logger.info(
            "preempted request %s (preemption #%d for it); it will be recomputed",
            request.req_id,
            request.num_preemptions,
        )

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData]) -> None:
        deferred: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            leader = request.prefill_leader
            if leader is not None and not leader.is_finished and not leader.prompt_done():
                deferred.append(self.waiting.pop())  # let its sibling fill the prefix cache first
                continue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            new_block_ids = self.kv_cache.allocate_slots(request, num_new, computed_blocks)
            if new_block_ids is None:
                break  # the pool is full: wait for running requests to finish
            self.waiting.pop()
            self.kv_cache.record_lookup(request.num_tokens, num_cached)
            request.prefill_leader = None
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.req_id] = num_new
            new_reqs.append(
                NewRequestData(
                    req_id=request.req_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=new_block_ids,
                    num_computed_tokens=num_cached,
                )
            )
            budget -= num_new
        for request in reversed(deferred):
            self.waiting.prepend(request)

    def _record_step(self, num_scheduled: dict[str, int], total: int) -> None:
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += total
        bs = self.kv_cache.block_size
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            self.stats.kv_slots_used += request.num_computed_tokens + n
            self.stats.kv_slots_allocated += len(self.kv_cache.req_blocks[req_id]) * bs

    # ------------------------------------------------------------------ results of a step
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += n
            prompt_lps = runner_output.prompt_logprobs.get(req_id)
            token = runner_output.sampled_token_ids.get(req_id)
            if token is None:
                if prompt_lps:
                    outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=prompt_lps))
                continue
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            out = EngineCoreOutput(
                req_id,
                [token],
                new_logprobs=runner_output.logprobs.get(req_id),
                new_prompt_logprobs=prompt_lps,
            )
            status = request.check_stop(token)
            if status is not None:
                out.finish_reason = status.value
                out.stop_reason = request.stop_reason
                self.finish_request(req_id, status)
            outputs.append(out)
        return outputs
