"""The engine core on its own thread, driven from asyncio: one stream of RequestOutputs per request.

The engine thread does nothing but apply commands (add, abort) between steps and run
`EngineCore.step()`; torch releases the GIL inside its kernels, so the asyncio side meanwhile parses
HTTP, tokenizes prompts, detokenizes outputs and applies stop strings. Commands reach the engine
thread through a `queue.Queue`; each step's outputs come back through `loop.call_soon_threadsafe`.
Both sides share memory, so nothing is serialized (no pickle, no socket).

Usage::

    engine = AsyncEngine(EngineArgs(model=...))
    engine.start()  # inside a running event loop
    prepared = engine.prepare("req-1", "Hello", SamplingParams(max_tokens=8))
    async for out in engine.generate(prepared):  # queued when generate() is called
        print(out.outputs[0].delta_text, end="")

A stream that its consumer stops reading (a client that disconnects) aborts its request: the
engine frees its KV blocks before its next step. A model step that raises marks the engine dead:
every in-flight request ends with `EngineDeadError` and nothing new is accepted.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.config import EngineArgs
from tokenmill.core.request import Request, RequestStatus
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, PreparedRequest, Prompt
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.loader.hf import load_tokenizer
from tokenmill.outputs import EngineCoreOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle engine thread waits for a command before it beats again.
_IDLE_POLL_S = 0.5


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a model step failed, or it was shut down)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state right after a step, taken on the engine thread."""

    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # tokens the waiting requests still have to compute
    kv_cache_usage: float  # share of KV blocks held by live requests
    num_free_blocks: int
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, tokens
    prefix_cache_hits: int  # cumulative, tokens
    num_step_tokens: int  # tokens scheduled by this step
    last_add_seq: int  # every add command up to this one is counted above


class StatsListener(Protocol):
    """What the metrics side hears from the engine (all calls on the event loop)."""

    def on_step(self, snapshot: EngineSnapshot) -> None: ...

    def on_tokens(self, stream: RequestStream, num_new_tokens: int, now: float) -> None: ...

    def on_finished(self, stream: RequestStream, output: RequestOutput) -> None: ...


@dataclass(eq=False)
class RequestStream:
    """One request's outputs on their way to its consumer, plus the timings metrics need."""

    request_id: str
    children: list[Request]
    num_prompt_tokens: int
    arrival_time: float  # time.monotonic() when the caller first saw the request
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False

    def metrics(self) -> RequestMetrics:
        """Core timings (queue, prefill, decode) of the request's children, merged."""
        first = self.children[0]
        first_tokens = [c.first_token_time for c in self.children if c.first_token_time is not None]
        scheduled = [c.first_scheduled_time for c in self.children if c.first_scheduled_time is not None]
        return RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min(scheduled) if scheduled else None,
            first_token_time=min(first_tokens) if first_tokens else None,
            finished_time=max((c.finished_time or 0.0) for c in self.children) or None,
            num_preemptions=sum(c.num_preemptions for c in self.children),
            num_cached_tokens=first.num_cached_tokens,
        )


class AsyncEngine:
    def __init__(self, args: EngineArgs, stall_timeout_s: float = 300.0) -> None:
        self.config, source = args.create_engine_config()
        self.tokenizer = load_tokenizer(source.tokenizer) if source.tokenizer else None
        self.core = EngineCore(self.config, source)
        self.inputs = InputProcessor(
            self.tokenizer, self.config.model.vocab_size, source.eos_token_ids, self.core.scheduler
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.stall_timeout_s = stall_timeout_s
        self.stats: StatsListener | None = None
        self.streams: dict[str, RequestStream] = {}
        self.dead_reason: str | None = None  # set once the loop has stopped, for whatever reason
        self.failed = False  # the loop stopped because of an error (not a shutdown)
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._add_seq = itertools.count(1)
        # Adds the engine has not yet counted in a snapshot: (seq, requests, tokens).
        self._unacked: collections.deque[tuple[int, int, int]] = collections.deque()
        self.snapshot = EngineSnapshot(0, 0, 0, 0.0, self.core.num_blocks, 0, 0, 0, 0, 0)
        self._step_started: float | None = None  # set while a step runs

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; call from inside the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step; in-flight requests end as dead."""
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def is_stalled(self) -> bool:
        started = self._step_started
        return started is not None and time.monotonic() - started > self.stall_timeout_s

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
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
        prompt_token_ids: list[int] | None = None,
    ) -> PreparedRequest:
        """Tokenize and validate; raises ValueError with a message for the user."""
        return self.inputs.process(request_id, prompt, params, priority, prompt_token_ids)

    def add(self, prepared: PreparedRequest, arrival_time: float | None = None) -> RequestStream:
        """Queue a prepared request; its outputs arrive on the returned stream."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if prepared.request_id in self.streams:
            raise ValueError(f"request id {prepared.request_id!r} is already in use.")
        stream = RequestStream(
            prepared.request_id, prepared.children, len(prepared.prompt_token_ids),
            arrival_time if arrival_time is not None else time.monotonic(),
        )
        self.streams[prepared.request_id] = stream
        self.outputs.add_request(
            prepared.request_id, prepared.prompt, prepared.prompt_token_ids, prepared.params,
            [c.req_id for c in prepared.children],
        )
        seq = next(self._add_seq)
        self._unacked.append((seq, len(prepared.children), len(prepared.children) * stream.num_prompt_tokens))
        self._commands.put(("add", seq, prepared.children))
        return stream

    def generate(self, prepared: PreparedRequest, arrival_time: float | None = None
                 ) -> AsyncIterator[RequestOutput]:
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
        stream.finished = True
        output = self.outputs.abort(request_id)
        live = [c.req_id for c in stream.children if not c.is_finished]
        if live:
            self._commands.put(("abort", live, RequestStatus.FINISHED_ABORTED))
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

    # ------------------------------------------------------------------ step results (event loop side)
    def _on_step(self, core_outputs: list[EngineCoreOutput], snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot
        while self._unacked and self._unacked[0][0] <= snapshot.last_add_seq:
            self._unacked.popleft()
        if self.stats is not None:
            self.stats.on_step(snapshot)
        if not core_outputs:
            return
        results, to_stop = self.outputs.process(core_outputs)
        if to_stop:
            self._commands.put(("abort", to_stop, RequestStatus.FINISHED_STOPPED))
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
            if result.finished:
                stream.finished = True
                del self.streams[result.request_id]
                result.metrics = stream.metrics()
                if self.stats is not None:
                    self.stats.on_finished(stream, result)
            stream.queue.put_nowait(result)

    def _on_dead(self, reason: str, failed: bool) -> None:
        self.dead_reason, self.failed = reason, failed
        error = EngineDeadError(reason)
        for request_id, stream in list(self.streams.items()):
            stream.finished = True
            self.outputs.abort(request_id)
            stream.queue.put_nowait(error)
        self.streams.clear()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        assert self._loop is not None
        loop, last_seq = self._loop, 0
        try:
            while True:
                stop, last_seq, early = self._apply_commands(block=not self.core.has_unfinished(),
                                                             last_seq=last_seq)
                if stop:
                    _notify(loop, self._on_dead, "the engine was shut down.", False)
                    return
                if not self.core.has_unfinished() and not early:
                    continue
                failed_before = self.core.num_failed_steps
                steps_before = self.core.scheduler.stats.num_scheduled_tokens
                self._step_started = time.monotonic()
                outputs = early + self.core.step()
                self._step_started = None
                snapshot = self._take_snapshot(self.core.scheduler.stats.num_scheduled_tokens - steps_before,
                                               last_seq)
                loop.call_soon_threadsafe(self._on_step, outputs, snapshot)
                if self.core.num_failed_steps > failed_before:
                    raise EngineDeadError("a model step failed; the engine stopped (see the server log).")
        except BaseException as exc:  # the loop must never die silently
            if not isinstance(exc, EngineDeadError):
                logger.exception("the engine loop failed")
            reason = str(exc) if isinstance(exc, EngineDeadError) else "the engine loop failed (see the server log)."
            _notify(loop, self._on_dead, reason, True)

    def _apply_commands(self, block: bool, last_seq: int) -> tuple[bool, int, list[EngineCoreOutput]]:
        """Apply queued commands; returns (stop?, last add seq applied, outputs for rejected adds)."""
        rejected: list[EngineCoreOutput] = []
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return False, last_seq, rejected
        while True:
            if command[0] == "stop":
                return True, last_seq, rejected
            if command[0] == "add":
                last_seq = command[1]
                for child in command[2]:
                    try:
                        self.core.add_request(child)
                    except ValueError as exc:  # validated already; never let one request stop the loop
                        rejected.append(EngineCoreOutput(child.req_id, [], finish_reason="error", error=str(exc)))
            else:
                for req_id in command[1]:
                    self.core.abort_request(req_id, command[2])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return False, last_seq, rejected

    def _take_snapshot(self, num_step_tokens: int, last_seq: int) -> EngineSnapshot:
        sched, kv = self.core.scheduler, self.core.kv_cache
        return EngineSnapshot(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.pool.num_free_blocks,
            num_preemptions=sched.stats.num_preemptions,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_step_tokens=num_step_tokens,
            last_add_seq=last_seq,
        )


def _notify(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop has closed: nobody is left to tell
        pass


def _merge(older: RequestOutput, newer: RequestOutput | BaseException) -> RequestOutput | BaseException:
    """One output standing for two consecutive ones: the newer state, with both steps' new text."""
    if isinstance(newer, BaseException):
        return newer
    for old, new in zip(older.outputs, newer.outputs):
        new.delta_text = old.delta_text + new.delta_text
    return newer
