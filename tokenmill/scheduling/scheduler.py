"""Iteration-level scheduler: each step hands out a token budget so that every request's
`num_computed_tokens` catches up with its `num_tokens`. Running requests first, then waiting ones;
prefill chunks and decodes share one batch; blocks running out preempt by recompute."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig, SpeculativeConfig
from tokenmill.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from tokenmill.scheduling.block_pool import Block
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.kv_tier import TierScheduler
from tokenmill.scheduling.online_traffic import OnlineTraffic
from tokenmill.scheduling.request import Request, RequestStatus
from tokenmill.scheduling.request_queue import make_queue

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodingStats:
    """Cumulative speculative-decoding counts (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose token at position i (0-based) was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    # Summed over steps, for the KV-slot utilisation (real tokens / allocated slots).
    kv_slots_used: int = 0
    kv_slots_allocated: int = 0
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)

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
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        speculative: SpeculativeConfig | None = None,
        idle_chunk_tokens: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_tier: TierScheduler | None = None,
        max_loras: int | None = None,
    ) -> None:
        """`kv_tier`: the second KV tier over `kv_cache`'s pool (None: none). `idle_chunk_tokens`: the
        prompt tokens an idle-class step computes while online traffic is recent
        (the runner's short-step size; None: no cap). `clock`: how recent online traffic is (tests fake it).
        `max_loras`: the most distinct LoRA adapters among running requests (the runner's resident
        slots; None: LoRA off)."""
        self.config = config
        self.kv_cache = kv_cache
        self.speculative = speculative
        # A draft model writes its drafts' KV past the tokens a step computes: reserve room for them.
        self.num_lookahead_tokens = (
            speculative.num_speculative_tokens if speculative is not None and speculative.method == "draft_model" else 0
        )
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._ended_since_last_step: set[str] = set()
        # Requests of steps launched and not yet updated (pipeline stages keep several in flight): no
        # later step schedules or preempts them until their step's output is in.
        self.in_flight: set[str] = set()
        self._req_cap = config.max_num_seqs  # this step's most requests (schedule's max_num_reqs)
        self._num_background = 0  # requests of the idle class (BACKGROUND_PRIORITY) not finished
        self.idle_chunk_tokens, self.clock = idle_chunk_tokens, clock
        self.kv_tier = kv_tier
        self.max_loras = max_loras
        self.online = OnlineTraffic()  # on the clock: steps with an online request
        # Async scheduling (config.async_scheduling): a step counts its tokens as computed when it is
        # scheduled, and a request that samples in it gets a placeholder token, so the next step can be
        # scheduled before this one's output is in. Live requests whose sampling reads their last tokens
        # on the host (SamplingParams.reads_sampled_tokens): while any is, the engine does not overlap.
        self.async_scheduling = config.async_scheduling
        self.num_sync_requests = 0
        self._chunk_room: int | None = None  # this step's room for idle-class prompt tokens (None: no cap)

    # ------------------------------------------------------------------ requests in and out
    @property
    def limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.config.max_model_len, self.kv_cache.block_size, self.kv_cache.num_blocks)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.limits.check(num_prompt_tokens, max_tokens)

    def add_request(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.num_reserved_tokens)
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use.")
        self.requests[request.req_id] = request
        self._num_background += request.background
        self.num_sync_requests += request.sampling_params.reads_sampled_tokens
        self.waiting.add(request)

    def finish_request(self, req_id: str, status: RequestStatus) -> None:
        """End a request (abort, stop string, error) wherever it is; frees its blocks at once."""
        request = self.requests.pop(req_id, None)
        if request is None:
            return
        self._num_background -= request.background
        self.num_sync_requests -= request.sampling_params.reads_sampled_tokens
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
    def schedule(self, max_num_reqs: int | None = None) -> SchedulerOutput:
        """The next step. `max_num_reqs`: at most this many requests in it (pipeline stages split the
        requests over the steps they keep in flight)."""
        self._req_cap = max_num_reqs if max_num_reqs is not None else self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        ended = self._ended_since_last_step
        self._ended_since_last_step = set()

        # Background requests sit out every step in which any other request runs or waits.
        idle = 0 < self._num_background < len(self.requests)
        # While online traffic is recent, their steps compute one short prompt chunk at most (beside
        # their decodes): a step an arriving online request waits behind stays short.
        now = self.clock()
        if self._num_background < len(self.requests):
            self.online.seen(now)
        self._chunk_room = self.idle_chunk_tokens if self.online.recent(now) else None
        budget, preempted = self._schedule_running(budget, num_scheduled, spec_tokens, cached_reqs, ended, idle)
        if not preempted:
            self._schedule_waiting(budget, num_scheduled, new_reqs, ended, idle)

        total = sum(num_scheduled.values())
        self._record_step(num_scheduled, total)
        if self.async_scheduling:
            self._count_as_computed(num_scheduled)
        out = SchedulerOutput(new_reqs, cached_reqs, num_scheduled, total, ended, spec_tokens)
        if self.kv_tier is not None:
            out.kv_saves, out.kv_loads, out.kv_deletes = self.kv_tier.take_step()
        return out

    def _count_as_computed(self, num_scheduled: dict[str, int]) -> None:
        """Async scheduling: the step's tokens are computed as far as the next schedule is concerned; a
        request whose step reaches its last token samples one more, known when the step's output is in."""
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.pooling_params is None and request.num_computed_tokens == (
                request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1

    def not_launched(self, sched: SchedulerOutput) -> None:
        """An empty step the engine does not run: the requests it reported ended go in the next one."""
        self._ended_since_last_step |= sched.finished_req_ids

    def step_failed(self, sched: SchedulerOutput) -> None:
        """The step's model run raised: blocks it was to load from the tier hold no such KV."""
        if self.kv_tier is not None:
            self.kv_tier.step_failed(sched.kv_loads)

    @property
    def speculating(self) -> bool:
        """Whether running requests verify drafts: speculation is configured and the batch is small
        enough for it to pay (disable_by_batch_size)."""
        spec = self.speculative
        return spec is not None and len(self.running) <= spec.disable_by_batch_size

    def _drafts_to_verify(self, request: Request, budget: int) -> list[int]:
        """The request's proposed drafts, cut so that the step fits the budget, the output never passes
        max_tokens (the last draft's step also emits one token of its own) and the sequence never
        passes max_model_len; none while its prompt is still being computed."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or not self.speculating or request.num_computed_tokens + 1 != request.num_tokens:
            return []
        room = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens,
        )
        return drafts[: max(room, 0)]

    def _victim_key(self, request: Request) -> tuple[int, float]:
        priority = request.priority if self.config.policy == "priority" else 0
        return (priority, request.arrival_time)

    def _schedule_running(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        spec_tokens: dict[str, list[int]],
        cached_reqs: list[CachedRequestData],
        ended: set[str],
        idle: bool,
    ) -> tuple[int, bool]:
        # Most important first, so the victims (taken from the tail) are the least important.
        self.running.sort(key=self._victim_key)
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < self._req_cap:
            request = self.running[i]
            if (idle and request.background) or request.req_id in self.in_flight or self._last_token_in_flight(request):
                i += 1
                continue
            # Draft tokens are scheduled tokens of the request: their KV slots are allocated with the rest.
            drafts = self._drafts_to_verify(request, budget)
            num_tokens = request.num_tokens + request.num_output_placeholders
            num_new = min(num_tokens + len(drafts) - request.num_computed_tokens, budget)
            num_new = self._cut_to_chunk(request, request.num_tokens - request.num_computed_tokens, num_new)
            if num_new == 0:
                i += 1
                continue
            new_block_ids = self._allocate_with_lookahead(request, num_new)
            if new_block_ids is None and drafts:  # drafts are optional: never preempt anyone for them
                drafts, num_new = [], num_new - len(drafts)
                new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self._pop_victim()
                if victim is None:  # the others' steps are in flight: wait for their blocks
                    break
                self._preempt(victim, ended)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            num_scheduled[request.req_id] = num_new
            if drafts:
                spec_tokens[request.req_id] = drafts
            cached_reqs.append(
                CachedRequestData(
                    request.req_id, new_block_ids, request.num_computed_tokens, self.kv_cache.new_group_block_ids
                )
            )
            budget -= num_new
            i += 1
        return budget, preempted

    @staticmethod
    def _last_token_in_flight(request: Request) -> bool:
        """Async scheduling: the request's max_tokens-th token is sampled by a step in flight."""
        placeholders = request.num_output_placeholders
        return placeholders > 0 and request.num_output_tokens + placeholders >= request.max_tokens

    def _cut_to_chunk(self, request: Request, remaining: int, num_new: int) -> int:
        """`num_new` cut to the step's room for idle-class prompt tokens (0 once it is spent); a decode row
        (`remaining` 1) and an online request pass."""
        room = self._chunk_room
        if room is None or not request.background or remaining == 1:
            return num_new
        num_new = min(num_new, room)
        self._chunk_room = room - num_new
        return num_new

    def _allocate_with_lookahead(
        self, request: Request, num_new: int, computed_blocks: list[Block] | None = None
    ) -> list[int] | None:
        """allocate_slots, with the draft model's lookahead slots while speculating if the pool has
        them; the lookahead alone never fails an allocation (the draft then proposes fewer)."""
        if self.num_lookahead_tokens and self.speculating:
            block_ids = self.kv_cache.allocate_slots(request, num_new, computed_blocks, self.num_lookahead_tokens)
            if block_ids is not None:
                return block_ids
        return self.kv_cache.allocate_slots(request, num_new, computed_blocks)

    def _pop_victim(self) -> Request | None:
        """The least important running request whose step is not in flight, taken out of running."""
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i].req_id not in self.in_flight:
                return self.running.pop(i)
        return None

    def _preempt_background(self, ended: set[str]) -> bool:
        """Preempt the last background request that runs (it sat out this step), for a waiting
        request the pool has no room for: else it could wait on blocks that idle requests hold."""
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i].background and self.running[i].req_id not in self.in_flight:
                self._preempt(self.running.pop(i), ended)
                return True
        return False

    def _preempt(self, request: Request, ended: set[str]) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Tokens that steps in flight sample for it are dropped: it computes them again when it resumes.
        request.num_stale_outputs += request.num_output_placeholders
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(request)
        ended.add(request.req_id)  # the runner drops its state; it comes back as a new request
        logger.info(
            "preempted request %s (preemption #%d for it); it will be recomputed",
            request.req_id,
            request.num_preemptions,
        )

    def _schedule_waiting(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        ended: set[str],
        idle: bool,
    ) -> None:
        deferred: list[Request] = []
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        while (
            len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(num_scheduled) < self._req_cap
        ):
            request = self.waiting.peek()
            leader = request.prefill_leader
            if leader is not None and not leader.is_finished and not leader.prompt_done():
                deferred.append(self.waiting.pop())  # let its sibling fill the prefix cache first
                continue
            lora = request.lora_request
            if lora is not None and lora.lora_int_id not in loras and len(loras) >= (self.max_loras or 0):
                deferred.append(self.waiting.pop())  # every adapter slot is taken: wait for one to free
                continue
            if request.background and (idle or self._chunk_room == 0):
                deferred.append(self.waiting.pop())
                continue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            if self.kv_tier is not None and self.kv_tier.load(request, computed_blocks):
                computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)  # with the loaded ones
            num_new = self._cut_to_chunk(
                request, request.num_tokens - num_cached, min(request.num_tokens - num_cached, budget)
            )
            new_block_ids = self._allocate_with_lookahead(request, num_new, computed_blocks)
            made_room = False
            while new_block_ids is None and not request.background and self._preempt_background(ended):
                made_room = True  # the victims went back to the queue, maybe ahead of this request
                new_block_ids = self._allocate_with_lookahead(request, num_new, computed_blocks)
            if new_block_ids is None:
                break  # the pool is full: wait for running requests to finish
            if made_room:
                self.waiting.remove(request)
            else:
                self.waiting.pop()
            self.kv_cache.record_lookup(request.num_tokens, num_cached)
            request.prefill_leader = None
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora is not None:
                loras.add(lora.lora_int_id)
            num_scheduled[request.req_id] = num_new
            new_reqs.append(
                NewRequestData(
                    req_id=request.req_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=new_block_ids,
                    num_computed_tokens=num_cached,
                    group_block_ids=self.kv_cache.new_group_block_ids,
                    pooling_params=request.pooling_params,
                    lora_request=request.lora_request,
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
        pooled = runner_output.pooled
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted while the step ran
            if request.num_stale_outputs and req_id in runner_output.sampled_token_ids:
                request.num_stale_outputs -= 1  # sampled before the request was preempted
                continue
            if request.status != RequestStatus.RUNNING:
                continue  # preempted while the step ran
            if self.async_scheduling:
                request.num_output_placeholders -= req_id in runner_output.sampled_token_ids
            else:
                request.num_computed_tokens += n
            if pooled and req_id in pooled:  # a pooling request ends with its prompt: its blocks go back now
                request.first_token_time = now
                outputs.append(EngineCoreOutput(req_id, [], finish_reason="stop", pooled=pooled[req_id]))
                self.finish_request(req_id, RequestStatus.FINISHED_STOPPED)
                continue
            prompt_lps = runner_output.prompt_logprobs.get(req_id)
            tokens = runner_output.sampled_token_ids.get(req_id)
            if not tokens:
                if prompt_lps:
                    outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=prompt_lps))
                continue
            drafts = scheduler_output.scheduled_spec_tokens.get(req_id)
            if drafts:
                self._count_drafts(request, len(drafts), len(tokens) - 1)
                # Rejected drafts: their KV slots stay allocated and are written over later.
                request.num_computed_tokens -= len(drafts) + 1 - len(tokens)
            outputs.append(self._append_tokens(request, tokens, runner_output, prompt_lps, now))
            if not request.is_finished:
                request.spec_token_ids = runner_output.spec_token_ids.get(req_id, [])
        return outputs

    def _count_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self.stats.spec.record(num_drafts, num_accepted)

    def _append_tokens(
        self,
        request: Request,
        tokens: list[int],
        runner_output: ModelRunnerOutput,
        prompt_lps: list[TokenLogprobs | None] | None,
        now: float,
    ) -> EngineCoreOutput:
        """Append a step's tokens one by one, stopping at the first that ends the request: nothing
        after a stop token (or past max_tokens) is emitted."""
        if request.first_token_time is None:
            request.first_token_time = now
        out = EngineCoreOutput(request.req_id, [], new_prompt_logprobs=prompt_lps)
        for token in tokens:
            request.output_token_ids.append(token)
            out.new_token_ids.append(token)
            status = request.check_stop(token)
            if status is not None:
                out.finish_reason = status.value
                out.stop_reason = request.stop_reason
                self.finish_request(request.req_id, status)
                break
        logprobs = runner_output.logprobs.get(request.req_id)
        if logprobs is not None:
            out.new_logprobs = logprobs[: len(out.new_token_ids)]
        return out
