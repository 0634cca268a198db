"""The async engine: one stream of RequestOutputs per request, with the engine core stepping elsewhere.

The asyncio side parses HTTP, tokenizes prompts, detokenizes outputs and applies stop strings; the
engine core only applies commands (add, abort) between steps and steps. By default the core runs in
a process of its own, so the two never share a GIL (core_client.py); `engine_process=False` puts it
on a thread of this process instead.

Usage::

    engine = AsyncEngine(EngineArgs(model=...))
    engine.start()  # inside a running event loop
    prepared = engine.prepare("req-1", "Hello", SamplingParams(max_tokens=8))
    async for out in engine.generate(prepared):  # queued when generate() is called
        print(out.outputs[0].delta_text, end="")

A stream that its consumer stops reading (a client that disconnects) aborts its request: the
engine frees its KV blocks before its next step. A model step that raises ends the requests in that
step only (core_loop.py). An engine that dies (its process killed, its loop failed) is replaced by
a new one (restart_policy.py bounds how often): requests that had produced no output yet are queued
again on it and complete; those under way end with `EngineDeadError`, as does a request that was
already requeued once (it may be what kills the engine). Requests that arrive meanwhile wait for
the new engine. Past the policy's bounds the engine stays dead and nothing new is accepted. An
engine that is hung rather than dead (no step finished within the step timeout while requests are
in flight, step_watchdog.py) is killed and replaced the same way.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tokenmill.config import EngineArgs
from tokenmill.engine.core_client import CoreClient, ProcessCoreClient, ThreadCoreClient
from tokenmill.engine.engine_args import create_engine_config
from tokenmill.engine.input_processor import InputProcessor, PreparedRequest, Prompt
from tokenmill.engine.messages import EngineDeadError, EngineSnapshot, EngineStep, NewRequest, RequestTimings
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.pooling_config import ModelPooling
from tokenmill.engine.request_limits import NO_CAPS, RequestCaps
from tokenmill.engine.request_metrics import merge_request_metrics
from tokenmill.engine.restart_policy import RestartPolicy
from tokenmill.engine.step_watchdog import StepWatchdog
from tokenmill.loader.hf import load_tokenizer
from tokenmill.lora.checker import AdapterChecker
from tokenmill.outputs import RequestMetrics, RequestOutput
from tokenmill.pooling_params import PoolingTask
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.request import RequestStatus
from tokenmill.startup_phases import StartupPhases

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineSnapshot", "RequestStream", "StatsListener"]


class StatsListener(Protocol):
    """What the metrics side hears from the engine (all calls on the event loop)."""

    def on_step(self, snapshot: EngineSnapshot) -> None: ...

    def on_tokens(self, stream: RequestStream, num_new_tokens: int, now: float) -> None: ...

    def on_finished(self, stream: RequestStream, output: RequestOutput) -> None: ...

    def on_restart(self) -> None: ...


@dataclass(eq=False)
class RequestStream:
    """One request's outputs on their way to its consumer, plus the timings metrics need. The front
    end's whole view of a request: what it sent (`children`, to send again to a new engine) and the
    core timings the engine last sent for each child; it mirrors no core Request."""

    request_id: str
    children: list[NewRequest]
    num_prompt_tokens: int
    arrival_time: float  # time.monotonic() when the caller first saw the request
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    delivered: bool = False  # an output has reached the consumer: it cannot be replayed on a new engine
    requeued: bool = False  # queued again once after an engine died
    timings: dict[str, RequestTimings] = field(default_factory=dict)  # child req_id -> latest from the engine

    def metrics(self) -> RequestMetrics:
        """Core timings (queue, prefill, decode) of the request's children, merged."""
        known = [self.timings[c.req_id] for c in self.children if c.req_id in self.timings]
        return merge_request_metrics(self.children[0].arrival_time, known)


class AsyncEngine:
    def __init__(
        self,
        args: EngineArgs,
        stall_timeout_s: float = 300.0,
        engine_process: bool = True,
        restart_policy: RestartPolicy | None = None,
        step_timeout_s: float | None = None,
        phases: StartupPhases | None = None,
        wait_ready: bool = True,
    ) -> None:
        """The engine process is spawned first, so it loads the model while this process loads the
        tokenizer (and, with `wait_ready=False`, whatever the caller sets up before it calls wait_ready).
        `phases` times this start and logs the engine's own phases once it is ready."""
        self.phases = phases if phases is not None else StartupPhases(level=None)
        self.restart_policy = restart_policy or RestartPolicy()
        self.restarting: str | None = None  # why, while a new engine starts after one died
        self.num_restarts = 0
        self._restart_task: asyncio.Task[None] | None = None
        self._closing = False
        self.stall_timeout_s = stall_timeout_s
        self.watchdog = StepWatchdog(step_timeout_s)
        self.stats: StatsListener | None = None
        self.streams: dict[str, RequestStream] = {}
        self._stream_of_child: dict[str, RequestStream] = {}  # child req_id -> its stream, while in flight
        self.dead_reason: str | None = None  # set once the loop has stopped, for whatever reason
        self.failed = False  # the loop stopped because of an error (not a shutdown)
        self._add_seq = itertools.count(1)
        # Adds the engine has not yet counted in a snapshot: (seq, requests, tokens).
        self._unacked: collections.deque[tuple[int, int, int]] = collections.deque()
        self._last_event = time.monotonic()  # when the engine last reported, for stall detection
        with self.phases.phase("config"):
            self.config, source = create_engine_config(args)
        self._eos_token_ids = source.eos_token_ids
        # Checks each request's LoRA adapter once, in this process (None: the engine serves none).
        lora = self.config.lora
        self.loras = AdapterChecker(self.config.model.hf_config, lora.max_lora_rank) if lora is not None else None
        client_type = ProcessCoreClient if engine_process else ThreadCoreClient

        def new_client() -> CoreClient:  # a replacement for an engine that died
            client = client_type(self.config, source)
            client.wait_ready()
            return client

        self._new_client: Callable[[], CoreClient] = new_client
        with self.phases.phase("engine process spawn" if engine_process else "engine load"):
            self.client: CoreClient = client_type(self.config, source)
        try:  # the front end's own set-up, while the engine process loads the model
            with self.phases.phase("tokenizer"):
                self.tokenizer: PreTrainedTokenizerBase | None = (
                    load_tokenizer(source.tokenizer) if source.tokenizer else None
                )
            self.outputs = OutputProcessor(self.tokenizer)
            self.pooling = ModelPooling.of(source.folder, self.config.model.hf_config)
        except BaseException:
            self.client.kill()
            raise
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for the engine to load its model (RuntimeError if it could not; the engine process is
        stopped on any error, Ctrl-C included), then take its limits."""
        try:
            with self.phases.phase("waiting for the engine"):
                engine_phases = self.client.wait_ready()
        except BaseException:
            self.client.kill()
            raise
        for name, seconds in engine_phases:
            self.phases.record(f"engine {name}", seconds)
        limits = self.client.limits
        self.inputs = InputProcessor(
            self.tokenizer, self.config.model.vocab_size, self._eos_token_ids, limits, loras=self.loras
        )
        self.num_blocks = limits.num_blocks
        self.snapshot = EngineSnapshot.idle(self.num_blocks)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine loop; call from inside the event loop that will consume outputs."""
        self.client.start(self._on_step, self._on_dead)
        self._watch_later()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine loop after its current step; in-flight requests end as dead."""
        self._closing = True  # a restart under way gives up (and stops what it started); the watchdog stops
        self.client.shutdown(timeout)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def is_stalled(self) -> bool:
        """Requests are in flight but the engine has not reported for stall_timeout_s."""
        return self._silent_s() > self.stall_timeout_s

    def _silent_s(self) -> float:
        """How long the engine has not reported while requests were in flight on it (0 if none are)."""
        if self.restarting is not None or self.dead_reason is not None or not self.streams:
            return 0.0
        return time.monotonic() - self._last_event

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    @property
    def vocab_size(self) -> int:
        return self.config.model.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def waiting_load(self) -> tuple[int, int]:
        """(requests, tokens) waiting to be scheduled, counting adds the engine has not seen yet."""
        reqs = self.snapshot.num_waiting + sum(n for _, n, _ in self._unacked)
        tokens = self.snapshot.num_waiting_tokens + sum(t for _, _, t in self._unacked)
        return reqs, tokens

    # ------------------------------------------------------------------ requests (event loop side)
    def prepare(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Tokenize and validate; raises ValueError with a message for the user."""
        return self.inputs.process(request_id, prompt, params, priority, prompt_token_ids, cache_salt)

    def prepare_pooling(
        self,
        request_id: str,
        prompt: Prompt,
        task: PoolingTask,
        priority: int = 0,
        cache_salt: str | None = None,
        caps: RequestCaps = NO_CAPS,
    ) -> PreparedRequest:
        """A pooling request (an embedding, a classification) as the model pools; ValueError for the user
        (RequestRejected over a cap). Its one output carries `pooled`."""
        params = self.pooling.params(task)
        return self.inputs.process_pooling(request_id, prompt, params, priority, cache_salt, caps)

    def add(self, prepared: PreparedRequest, arrival_time: float | None = None) -> RequestStream:
        """Queue a prepared request; its outputs arrive on the returned stream."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if prepared.request_id in self.streams:
            raise ValueError(f"request id {prepared.request_id!r} is already in use.")
        if not self.streams:  # the engine had nothing to report while idle
            self._last_event = time.monotonic()
        stream = RequestStream(
            prepared.request_id,
            [NewRequest.of(c) for c in prepared.children],
            len(prepared.prompt_token_ids),
            arrival_time if arrival_time is not None else time.monotonic(),
        )
        self.streams[prepared.request_id] = stream
        self._stream_of_child.update((c.req_id, stream) for c in stream.children)
        self.outputs.add_request(
            prepared.request_id,
            prepared.prompt,
            prepared.prompt_token_ids,
            prepared.params,
            [c.req_id for c in prepared.children],
            pooling=prepared.pooling_params is not None,
        )
        self._send(stream)
        return stream

    def _send(self, stream: RequestStream) -> None:
        """Queue the stream's requests in the engine (or count them as waiting for the one starting)."""
        seq = next(self._add_seq)
        self._unacked.append((seq, len(stream.children), len(stream.children) * stream.num_prompt_tokens))
        if self.restarting is None:
            self.client.add(seq, stream.children)

    def generate(self, prepared: PreparedRequest, arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Queue the request now, and return an iterator of its output after each step that changed it.
        If several steps' outputs are waiting, they come as one (its delta_text joins theirs).
        Closing the iterator early aborts the request (so does `abort`)."""
        return self._outputs(self.add(prepared, arrival_time))

    async def _outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                    item = _merge(item, stream.queue.get_nowait())
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """End a request now (finish_reason "abort"); its blocks are freed before the next step."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        self._end(stream)
        output = self.outputs.abort(request_id)
        if self.restarting is None:  # else no engine holds it
            self.client.abort([c.req_id for c in stream.children], RequestStatus.FINISHED_ABORTED)
        if output is not None:
            stream.queue.put_nowait(output)
            if self.stats is not None:
                self.stats.on_finished(stream, output)

    def abort_all(self) -> None:
        for request_id in list(self.streams):
            self.abort(request_id)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.streams

    def _end(self, stream: RequestStream) -> None:
        stream.finished = True
        for child in stream.children:
            self._stream_of_child.pop(child.req_id, None)

    # ------------------------------------------------------------------ step results (event loop side)
    def _on_step(self, step: EngineStep) -> None:
        snapshot = step.snapshot
        self.snapshot, self._last_event = snapshot, time.monotonic()
        self.watchdog.record(snapshot.step_seconds)
        while self._unacked and self._unacked[0][0] <= snapshot.last_add_seq:
            self._unacked.popleft()
        if self.stats is not None:
            self.stats.on_step(snapshot)
        for req_id, timings in step.timings.items():
            owner = self._stream_of_child.get(req_id)
            if owner is not None:
                owner.timings[req_id] = timings
        if not step.outputs:
            return
        results, to_stop = self.outputs.process(step.outputs)
        if to_stop:
            self.client.abort(to_stop, RequestStatus.FINISHED_STOPPED)
        now = time.monotonic()
        for result in results:
            stream = self.streams.get(result.request_id)
            if stream is None:
                continue
            num_tokens = sum(len(o.token_ids) for o in result.outputs)
            if num_tokens > stream.num_output_tokens:
                if self.stats is not None:
                    self.stats.on_tokens(stream, num_tokens - stream.num_output_tokens, now)
                stream.num_output_tokens = num_tokens
                stream.first_token_time = stream.first_token_time or now
                stream.last_token_time = now
            stream.delivered = True
            if result.finished:
                del self.streams[result.request_id]
                self._end(stream)
                result.metrics = stream.metrics()
                if self.stats is not None:
                    self.stats.on_finished(stream, result)
            stream.queue.put_nowait(result)

    def _on_dead(self, reason: str, failed: bool) -> None:
        if failed and not self._closing and self.restart_policy.allow():
            self._begin_restart(reason)
        else:
            self._give_up(reason, failed)

    def _give_up(self, reason: str, failed: bool) -> None:
        if failed:  # the reason's one place for the operator: /health does not say it
            logger.error("the engine is dead, no more restarts: %s", reason)
        self.restarting = None
        self.dead_reason, self.failed = reason, failed
        for request_id in list(self.streams):
            self._fail(request_id, reason)

    def _fail(self, request_id: str, reason: str) -> None:
        stream = self.streams.pop(request_id)
        self._end(stream)
        self.outputs.abort(request_id)
        stream.queue.put_nowait(EngineDeadError(reason))

    # ------------------------------------------------------------------ watchdog (event loop side)
    def _watch_later(self) -> None:
        if self.watchdog.enabled:
            asyncio.get_running_loop().call_later(self.watchdog.check_interval(), self._watch)

    def _watch(self) -> None:
        """A hung engine is killed and replaced as a dead one is. Events the engine sent before it went
        quiet are handled first: the loop runs ready I/O callbacks before this timer's."""
        if self._closing or self.dead_reason is not None:  # stopped for good
            return
        silent_s = self._silent_s()
        if self.watchdog.is_hung(silent_s):
            reason = (
                f"no engine step finished for {silent_s:.0f} s (the step timeout is {self.watchdog.limit():.0f} s, "
                "--engine-step-timeout): the engine is hung."
            )
            logger.error("%s Killing it.", reason)
            self.client.kill()
            self._on_dead(reason, True)
        self._watch_later()

    # ------------------------------------------------------------------ restart (event loop side)
    def _begin_restart(self, reason: str) -> None:
        logger.error("the engine died (%s); starting a new one", reason)
        self.restarting = reason
        for request_id, stream in list(self.streams.items()):
            # Output already sent cannot be taken back, and a request that was in flight at two
            # deaths may be their cause: both end. The rest run again from their prompts.
            if stream.delivered or stream.requeued:
                self._fail(request_id, reason)
            else:
                stream.requeued = True
        self._unacked.clear()
        self.snapshot = EngineSnapshot.idle(self.num_blocks)
        self._restart_task = asyncio.ensure_future(self._restart(reason, self.client))

    async def _restart(self, reason: str, dead: CoreClient) -> None:
        await asyncio.to_thread(dead.shutdown, 5.0)  # reap its process and writer thread
        for attempt, delay in enumerate(self.restart_policy.delays(), 1):
            await asyncio.sleep(delay)
            if self._closing:
                return
            try:
                client = await asyncio.to_thread(self._new_client)
            except Exception as exc:  # noqa: BLE001 - logged; the next try or giving up follows
                logger.error("starting a new engine failed (try %d): %s", attempt, exc)
                continue
            if self._closing:
                await asyncio.to_thread(client.shutdown, 5.0)
                return
            self._resume(client)
            return
        self._give_up(f"{reason} Starting a new engine failed {len(self.restart_policy.delays())} times.", True)

    def _resume(self, client: CoreClient) -> None:
        """Put the new engine in place and queue again every request still waiting for one."""
        self.client, self.restarting = client, None
        self.num_restarts += 1
        self._last_event = time.monotonic()
        client.start(self._on_step, self._on_dead)
        for stream in self.streams.values():
            stream.timings.clear()  # the dead engine's; the new one builds its requests afresh
            self._send(stream)
        logger.warning("a new engine is running; %d requests queued again", len(self.streams))
        if self.stats is not None:
            self.stats.on_restart()


def _merge(older: RequestOutput, newer: RequestOutput | BaseException) -> RequestOutput | BaseException:
    """One output standing for two consecutive ones: the newer state, with both steps' new text."""
    if isinstance(newer, BaseException):
        return newer
    for old, new in zip(older.outputs, newer.outputs):
        new.delta_text = old.delta_text + new.delta_text
    return newer
