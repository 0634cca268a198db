"""The engine core: scheduler + KV cache manager + model runner, driven one step at a time.

One step = schedule() -> execute(SchedulerOutput) -> update_from_output(ModelRunnerOutput)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.process_tuning import freeze_startup_heap, keep_freed_memory
from tokenmill.executor import Executor, ExecutorDeadError, make_executor
from tokenmill.kv_groups import UNBOUNDED, budget_num_blocks
from tokenmill.kv_tier.index import TierIndex
from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.loader.hf import load_tokenizer
from tokenmill.loader.model_source import ModelSource
from tokenmill.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.sampling_params import params_for_wire
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.kv_tier import TierScheduler
from tokenmill.scheduling.request import Request, RequestStatus
from tokenmill.scheduling.scheduler import Scheduler
from tokenmill.startup_phases import StartupPhases
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.llguidance_backend import LLGuidanceBackend
from tokenmill.structured.waitlist import GrammarWaitlist

logger = logging.getLogger(__name__)

# How long a step with nothing to run but grammars compiling waits for one: new commands wait as long.
GRAMMAR_POLL_S = 0.01


def num_kv_blocks(config: EngineConfig, runner: Executor) -> int:
    """An explicit count, else what the memory budget holds (never more than every sequence could use
    at full length: beyond that, blocks only serve as prefix cache, which the budget still bounds).
    The budget: kv_cache_memory_gb on CPU; on CUDA, what profiling the largest step leaves."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    per_block = runner.kv_cache_bytes_per_block()
    if runner.device.type == "cuda":
        total, peak = profile_peak_memory(runner)
        blocks = profiled_num_kv_blocks(total, peak, config.cache.gpu_memory_utilization, per_block)
    else:
        blocks = int(config.cache.kv_cache_memory_gb * 2**30 // per_block)
    driver = runner.driver
    if driver.kv_groups.num_groups > 1:  # window groups need fewer blocks: the budget buys group 0 more
        caps = [None, *driver.group_pool_blocks(UNBOUNDED)[1:]]  # each window group at most its cap
        blocks = budget_num_blocks(blocks * per_block, driver.kv_cache_bytes_per_group_block(), caps)
    blocks_per_seq = -(-config.scheduler.max_model_len // config.cache.block_size)
    return max(1, min(blocks, 2 * config.scheduler.max_num_seqs * blocks_per_seq))


def profiled_num_kv_blocks(total_bytes: int, peak_bytes: int, utilization: float, per_block_bytes: int) -> int:
    """KV blocks that fit in `utilization` of the device's `total_bytes` beside `peak_bytes`, the most
    the engine used without a KV cache (weights, the largest step's activations and sampling, memory
    outside PyTorch). Raises a ValueError that says what to change when not one block fits."""
    budget = int(total_bytes * utilization) - peak_bytes
    if budget < per_block_bytes:
        gib = 2**30
        raise ValueError(
            f"no room for the KV cache: {utilization:g} of the GPU's {total_bytes / gib:.2f} GiB is "
            f"{total_bytes * utilization / gib:.2f} GiB, and the weights and the largest step already peak at "
            f"{peak_bytes / gib:.2f} GiB (one KV block needs {per_block_bytes / 2**20:.2f} MiB). Raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs, or use a smaller "
            f"model or dtype."
        )
    return budget // per_block_bytes


def profile_peak_memory(runner: Executor) -> tuple[int, int]:
    """(the device's total bytes, the peak bytes in use around `runner.profile_run()`): PyTorch's peak
    allocation plus the device memory in use outside PyTorch's allocator (the CUDA context, libraries,
    other processes). CUDA graphs, captured later, live in what `gpu_memory_utilization` leaves over."""
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner.profile_run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    logger.info(
        "profiled the largest step: peak %.2f GiB in PyTorch + %.2f GiB outside it, of %.2f GiB",
        peak / 2**30,
        max(0, outside_torch) / 2**30,
        total / 2**30,
    )
    return total, peak + max(0, outside_torch)


@dataclass
class DecodeStepStats:
    """Steps that ran only decode rows (one token per request): their wall time (schedule, model,
    sampling, bookkeeping) and the tokens they sampled, i.e. the decode rate without the prefills."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0


@dataclass(frozen=True)
class InFlightStep:
    """A launched step not yet collected: its schedule, the KV tokens it reads, when it was launched, and
    (async scheduling) whether some live request's sampling read its tokens on the host then."""

    sched: SchedulerOutput
    context: int
    launched_at: float
    sync: bool = False


@dataclass(frozen=True)
class StepShape:
    """The last model step: its wall time (schedule, model, sampling, bookkeeping), its decode rows (one
    new token each, plus any drafts they verify) and the prompt tokens of its prefill chunks. The
    planner's step-time model (tokenmill/planner/step_model.py) is fitted to these. `bytes_read`
    estimates the memory traffic: the weights once per forward plus the KV cache attention reads."""

    seconds: float = 0.0
    decode_rows: int = 0
    prefill_tokens: int = 0
    bytes_read: int = 0


def weight_bytes(model: object) -> int:
    """Bytes of the model's parameters and buffers (each storage once: tied weights, packed views); 0 for
    a model that is not an nn.Module."""
    if not isinstance(model, torch.nn.Module):
        return 0
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def grammar_compiler(config: EngineConfig, source: ModelSource) -> GrammarCompiler:
    """The engine's own grammar compiler: it loads the model's tokenizer when the first request with
    structured_outputs arrives (the front end that checked the request may be another process)."""
    tokenizer = source.tokenizer
    if tokenizer is None:
        return GrammarCompiler(None)
    vocab_size, eos = config.model.vocab_size, source.eos_token_ids
    return GrammarCompiler(lambda: LLGuidanceBackend(load_tokenizer(tokenizer), vocab_size, eos))


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        grammars: GrammarCompiler | None = None,
        phases: StartupPhases | None = None,
    ) -> None:
        """`grammars`: a compiler to share with the front end in this process (LLM does); else its own.
        `phases` times the model load and the KV cache (recorded only, unless the caller's logs them)."""
        self.config = config
        # The second KV tier's counters (--kv-offloading-size), None without a tier.
        self.kv_tier_stats: KVTierStats | None = None
        phases = phases if phases is not None else StartupPhases(level=None)
        self.grammars = grammars if grammars is not None else grammar_compiler(config, source)
        self.grammar_waitlist: GrammarWaitlist[Request] = GrammarWaitlist()
        # One model runner per tensor-parallel rank; `runner` is rank 0's, in this process.
        with phases.phase("model"):
            self.executor = make_executor(config, source.folder, source.eos_token_ids, self.grammars)
        self.runner = self.executor.driver
        try:
            with phases.phase("KV cache"):
                self.num_blocks = num_kv_blocks(config, self.executor)  # rank 0 decides, every rank allocates
                self.executor.allocate_kv_cache(self.num_blocks)
                pools = self.runner.group_pool_blocks(self.num_blocks)
                self.kv_cache = KVCacheManager(
                    self.num_blocks,
                    config.cache.block_size,
                    config.cache.enable_prefix_caching,
                    window_groups=list(zip(self.runner.kv_groups.windows, pools[1:])),
                )
                tier = self._open_kv_tier() if config.cache.kv_offloading_size is not None else None
            with phases.phase("warm-up"):
                self.executor.capture_cuda_graphs()  # CUDA only; after the cache, which the graphs read in place
        except BaseException:
            self.executor.shutdown()
            raise
        self.dead_reason: str | None = None  # set when a rank died: every later step raises
        # The idle class's short chunks: prompt pieces the fused decode stack takes, steps as short as a decode.
        fused = self.runner.fused_decode
        idle_chunk = fused.MAX_QUERY_LEN if fused is not None else None
        max_loras = config.lora.max_loras if config.lora is not None else None
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache, config.speculative, idle_chunk, kv_tier=tier, max_loras=max_loras
        )
        self.num_idle_steps = 0  # consecutive steps that scheduled nothing while requests waited
        self.num_failed_steps = 0  # model steps that raised (each ended only its own requests)
        self.decode_stats = DecodeStepStats()
        self.last_step = StepShape()
        # Launched steps not yet collected, oldest first (pipeline stages; async scheduling).
        self._in_flight: deque[InFlightStep] = deque()
        self._last_collect_at = 0.0  # when the last in-flight step was collected
        # Every rank reads its own shard of the weights and of the KV cache: count them all (pipeline
        # stages: as many as rank 0's, an estimate where the stages are uneven).
        ranks = config.parallel.world_size
        self.weight_bytes = weight_bytes(self.runner.model) * ranks
        self.kv_bytes_per_token = self.executor.kv_cache_bytes_per_block() * ranks // config.cache.block_size
        logger.info(
            "engine ready: %d KV blocks of %d tokens (%s), dtype %s (weights %s), attention %s, fused decode %s, "
            "speculative %s, async scheduling %s",
            self.num_blocks,
            config.cache.block_size,
            config.cache.kv_cache_dtype,
            config.model.dtype,
            config.model.weight_dtype or config.model.dtype,
            self.runner.backend.name,
            "on" if self.runner.fused_decode_off_reason is None else f"off ({self.runner.fused_decode_off_reason})",
            "off" if (spec := config.speculative) is None else f"{spec.method} k={spec.num_speculative_tokens}",
            "on" if config.scheduler.async_scheduling else "off",
        )
        freeze_startup_heap()
        keep_freed_memory()

    def _open_kv_tier(self) -> TierScheduler:
        """Open the second KV tier: its store on the runner, and the scheduler's index of what it holds
        (after a restart, the blocks a file tier kept, the oldest dropped beyond the capacity)."""
        cache = self.config.cache
        size = cache.kv_offloading_size or 0.0
        if self.config.parallel.world_size > 1:
            raise ValueError(
                "--kv-offloading-size works with --tensor-parallel-size 1 and --pipeline-parallel-size 1 only "
                "(for now); drop one."
            )
        if self.runner.kv_groups.num_groups > 1:
            raise ValueError("--kv-offloading-size does not serve sliding-window models (for now); drop it.")
        if not cache.enable_prefix_caching:
            raise ValueError("--kv-offloading-size keeps prefix-cache blocks: it needs prefix caching on.")
        stats = KVTierStats()
        io = self.runner.open_kv_tier(stats)
        if cache.kv_role != "both" and not io.store.persistent:
            raise ValueError(f"kv_role {cache.kv_role!r} shares the CPU file tier's folder; on CUDA it is host memory.")
        capacity = int(size * 2**30 // io.block_nbytes)
        if capacity < 1:
            raise ValueError(
                f"--kv-offloading-size {size:g} GiB holds no KV block of {io.block_nbytes / 2**20:.2f} MiB; raise it."
            )
        index, over = TierIndex.of(capacity, io.store.hashes())
        for block_hash in over:
            io.writer.delete(block_hash)
        self.kv_tier_stats = stats
        logger.info(
            "second KV tier: %d blocks of %.2f MiB (%g GiB) in %s; %d blocks kept from before",
            capacity,
            io.block_nbytes / 2**20,
            size,
            getattr(io.store, "folder", "host memory"),
            len(index),
        )
        probe = io.probe if cache.kv_role == "decode" else None  # blocks prefill engines saved
        return TierScheduler(self.kv_cache, index, stats, io.fetch, probe)

    def add_request(self, request: Request) -> None:
        # The executor's followers get the params on the wire (a dict schema as its text).
        request.sampling_params = params_for_wire(request.sampling_params)
        spec = request.sampling_params.structured_outputs
        if spec is not None and self.grammars.cached(spec) is None:  # compiles off the step loop
            self.grammar_waitlist.add(request.req_id, request, self.grammars.compile_async(spec))
            return
        self.scheduler.add_request(request)

    def abort_request(self, req_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.grammar_waitlist.remove(req_id)
        self.scheduler.finish_request(req_id, status)

    def has_unfinished(self) -> bool:
        """Requests to run, or a step in flight to collect."""
        return self.scheduler.has_unfinished() or len(self.grammar_waitlist) > 0 or bool(self._in_flight)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op at tensor_parallel_size 1); finish the second KV
        tier's writes."""
        tier_io, tier = self.runner.kv_tier, self.scheduler.kv_tier
        if tier_io is not None and tier is not None:
            if tier_io.store.persistent:  # the pool's prefixes too: the hottest, found after a restart
                tier_io.close(*tier.save_pool())
            else:
                tier_io.close()
            self.runner.kv_tier = None
        self.executor.shutdown()

    def step(self) -> list[EngineCoreOutput]:
        if self.dead_reason is not None:
            raise ExecutorDeadError(self.dead_reason)
        self.last_step = StepShape()  # until a step is collected in this call
        compiled = self._admit_compiled()
        if len(self.grammar_waitlist) and not self.scheduler.has_unfinished():  # wait a little, never spin
            self.grammar_waitlist.wait(GRAMMAR_POLL_S)
            return compiled
        if self.executor.pipeline_depth > 1:
            return compiled + self._step_pipelined()
        return compiled + (self._step_async() if self.scheduler.async_scheduling else self._step())

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Schedule the requests whose grammar has compiled; those it failed for end with its error."""
        if not len(self.grammar_waitlist):
            return []
        compiled = self.grammar_waitlist.take_compiled()
        for request in compiled.ready:
            self.scheduler.add_request(request)
        outputs = []
        for request, error in compiled.failed:
            request.status = RequestStatus.FINISHED_ERROR
            outputs.append(EngineCoreOutput(request.req_id, [], finish_reason="error", error=error))
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.has_kv_transfers:
            self.num_idle_steps = self.num_idle_steps + 1 if self.has_unfinished() else 0
            if self.num_idle_steps > 2:  # cannot happen if admission checks hold; never hang on it
                return self._fail(list(self.scheduler.requests), "the scheduler could not place this request")
            if not sched.finished_req_ids:
                return []
        else:
            self.num_idle_steps = 0
        context = self._context_tokens(sched)
        try:
            runner_out = self.executor.execute(sched)
        except ExecutorDeadError as exc:
            return self._executor_died(exc)
        except Exception as exc:  # noqa: BLE001 (a failed forward ends the step's requests, never the engine)
            return self._step_failed(sched, exc)
        outputs = self.scheduler.update_from_output(sched, runner_out)
        self._record_step(sched, runner_out, context, time.perf_counter() - start)
        if self.config.cache.kv_role == "prefill" and any(o.finished for o in outputs):
            self._save_prefixes()
        return outputs

    def _context_tokens(self, sched: SchedulerOutput) -> int:
        """The KV tokens attention reads in a step just scheduled: each request's context up to its last
        new token (async scheduling has counted the step's tokens as computed already)."""
        requests = self.scheduler.requests
        context = sum(requests[r].num_computed_tokens for r in sched.num_scheduled_tokens)
        return context if self.scheduler.async_scheduling else context + sched.total_num_scheduled_tokens

    def _step_async(self) -> list[EngineCoreOutput]:
        """Async scheduling: launch the next step while the last is still running, then collect that one.
        The device queues the new step behind the running one, so the host's work (collecting, the
        scheduler's update, the front end's output processing, the next schedule) hides behind the
        device's instead of leaving it idle. A request's last sampled token stays on the device for its
        next step (the scheduler holds a placeholder for it). While a live request's sampling reads its
        tokens on the host (a grammar, penalties), each step is collected before the next is scheduled."""
        outputs: list[EngineCoreOutput] = []
        sync = self.scheduler.num_sync_requests > 0
        if sync or any(step.sync for step in self._in_flight):  # (a step with such requests, since ended)
            while self._in_flight:
                outputs += self._collect_oldest()
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        launched = not sched.is_empty
        if launched:
            step = InFlightStep(sched, self._context_tokens(sched), start, sync)
            try:
                self.executor.launch(sched)
            except ExecutorDeadError as exc:
                return outputs + self._executor_died(exc)
            except Exception as exc:  # noqa: BLE001 (a failed launch ends the step's requests, never the engine)
                outputs += self._step_failed(sched, exc)
                launched = False
            else:
                self._in_flight.append(step)
        else:
            self.scheduler.not_launched(sched)
        if self._in_flight and (len(self._in_flight) > 1 or not launched):
            outputs += self._collect_oldest()
        elif not self._in_flight:
            self.num_idle_steps = self.num_idle_steps + 1 if self.scheduler.has_unfinished() else 0
            if self.num_idle_steps > 2:  # cannot happen if admission checks hold; never hang on it
                return outputs + self._fail(list(self.scheduler.requests), "the scheduler could not place this request")
            return outputs
        self.num_idle_steps = 0
        return outputs

    def _collect_oldest(self) -> list[EngineCoreOutput]:
        """Async scheduling: the oldest in-flight step's output, applied."""
        step = self._in_flight.popleft()
        try:
            runner_out = self.executor.collect()
        except ExecutorDeadError as exc:
            return self._executor_died(exc)
        except Exception as exc:  # noqa: BLE001
            return self._step_failed(step.sched, exc)
        outputs = self.scheduler.update_from_output(step.sched, runner_out)
        now = time.perf_counter()
        # The step's share of the wall time: from its launch, or from the last collect if it ran behind that one.
        self._record_step(step.sched, runner_out, step.context, now - max(step.launched_at, self._last_collect_at))
        self._last_collect_at = now
        return outputs

    def _executor_died(self, exc: ExecutorDeadError) -> list[EngineCoreOutput]:
        """The ranks cannot go on together: end every request and the engine."""
        logger.error("tensor-parallel engine stopped: %s", exc)
        self.dead_reason = f"engine error: {exc}"
        self._in_flight.clear()
        self.executor.shutdown()
        return self._fail(list(self.scheduler.requests), self.dead_reason)

    def _step_failed(self, sched: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """A step's model run raised: its requests still live end with the error, the engine goes on."""
        self.scheduler.step_failed(sched)
        self.num_failed_steps += 1
        live = [r for r in sched.num_scheduled_tokens if r in self.scheduler.requests]
        logger.error("model step failed; ending the %d requests in it", len(live), exc_info=exc)
        return self._fail(live, f"engine error during the model step: {exc!r}")

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Pipeline stages (virtual engines): launch steps until `pipeline_depth` are in flight, each of
        requests no other in-flight step holds, then take the oldest's output. While the last stage
        finishes one step the first stage already runs the next, instead of idling until the output."""
        start = time.perf_counter()
        depth = self.executor.pipeline_depth
        while len(self._in_flight) < depth:
            sched = self.scheduler.schedule(self._pipeline_share(depth - len(self._in_flight)))
            if sched.is_empty:
                self.scheduler.not_launched(sched)
                break
            self.scheduler.in_flight.update(sched.num_scheduled_tokens)
            self._in_flight.append(InFlightStep(sched, self._context_tokens(sched), start))
            try:
                self.executor.launch(sched)
            except Exception as exc:  # noqa: BLE001 (any failure leaves the stages out of step)
                return self._stop_pipeline(exc)
        if not self._in_flight:
            self.num_idle_steps = self.num_idle_steps + 1 if self.has_unfinished() else 0
            if self.num_idle_steps > 2:  # cannot happen if admission checks hold; never hang on it
                return self._fail(list(self.scheduler.requests), "the scheduler could not place this request")
            return []
        self.num_idle_steps = 0
        step = self._in_flight.popleft()
        try:
            runner_out = self.executor.collect()
        except Exception as exc:  # noqa: BLE001
            return self._stop_pipeline(exc)
        self.scheduler.in_flight.difference_update(step.sched.num_scheduled_tokens)
        outputs = self.scheduler.update_from_output(step.sched, runner_out)
        self._record_step(step.sched, runner_out, step.context, time.perf_counter() - start)
        return outputs

    def _pipeline_share(self, free_slots: int) -> int:
        """Requests for the next launched step: those not in flight, shared over the free slots, so the
        steps in flight hold about equal parts (one step holding every request would leave nothing to
        launch beside it, and the stages would take turns instead of overlapping)."""
        scheduler = self.scheduler
        admissible = max(0, min(len(scheduler.waiting), scheduler.config.max_num_seqs - len(scheduler.running)))
        ready = sum(r.req_id not in scheduler.in_flight for r in scheduler.running) + admissible
        return max(1, -(-ready // free_slots))

    def _stop_pipeline(self, exc: Exception) -> list[EngineCoreOutput]:
        """A stage failed with steps in flight: the ranks cannot go on together; end every request."""
        logger.error("pipeline-parallel engine stopped: %s", exc)
        self.dead_reason = f"engine error: {exc}"
        self._in_flight.clear()
        self.scheduler.in_flight.clear()
        self.executor.shutdown()
        return self._fail(list(self.scheduler.requests), self.dead_reason)

    def _record_step(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput, context: int, seconds: float) -> None:
        """The step's shape and time (last_step, decode_stats). `context`: the KV tokens it read."""
        num_drafts = sum(len(d) for d in sched.scheduled_spec_tokens.values())
        # A row computing one token (beside its drafts) decodes; a longer one is a prompt chunk.
        rows = sum(n - len(sched.scheduled_spec_tokens.get(r, ())) == 1 for r, n in sched.num_scheduled_tokens.items())
        prefill_tokens = sched.total_num_scheduled_tokens - num_drafts - rows
        bytes_read = self.weight_bytes + context * self.kv_bytes_per_token
        self.last_step = StepShape(seconds, rows, prefill_tokens, bytes_read)
        if prefill_tokens == 0:  # decode rows only
            self.decode_stats.steps += 1
            self.decode_stats.seconds += seconds
            self.decode_stats.tokens += sum(len(t) for t in runner_out.sampled_token_ids.values())

    def _save_prefixes(self) -> None:
        """A prefill engine's finished requests' prompt blocks (every cached prefix the tier lacks) into the
        shared tier's folder, written before their outputs are returned: a decode engine asked next finds
        them."""
        tier_io, tier = self.runner.kv_tier, self.scheduler.kv_tier
        if tier_io is not None and tier is not None:
            tier_io.save_now(*tier.save_pool())

    def _fail(self, req_ids: list[str], message: str) -> list[EngineCoreOutput]:
        for req_id in req_ids:
            self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(r, [], finish_reason="error", error=message) for r in req_ids]
