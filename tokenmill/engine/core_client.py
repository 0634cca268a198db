"""Where the engine core runs, seen from the asyncio front end: a thread or a process of its own.

Both clients take commands (add, abort) from the event loop and call `on_step` / `on_dead` on it.

- `ProcessCoreClient` (the server's default): the core runs in a spawned process, so the step
  loop never shares a GIL with HTTP parsing, tokenization and detokenization. Commands and events
  cross two one-way OS pipes (not sockets) as msgpack (messages.COMMANDS, messages.EVENTS); a
  writer thread keeps the event loop from ever blocking on a full pipe. If the process dies,
  `on_dead` reports it.
- `ThreadCoreClient`: the core on a thread of this process (tests inspect and patch the core in
  place; `--engine-in-thread` for debugging). Nothing is serialized.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import (
    COMMANDS,
    EVENTS,
    AbortRequests,
    AddRequests,
    Command,
    EngineDead,
    EngineReady,
    EngineStartFailed,
    EngineStep,
    NewRequest,
    Stop,
)
from tokenmill.loader.model_source import ModelSource
from tokenmill.log_format import configure_child_logging
from tokenmill.scheduling.request import RequestStatus
from tokenmill.scheduling.scheduler import AdmissionLimits
from tokenmill.startup_phases import StartupPhases

logger = logging.getLogger(__name__)

OnStep = Callable[[EngineStep], None]
OnDead = Callable[[str, bool], None]  # (reason, failed: an error rather than a shutdown)

# How long start-up may take (loading and converting a model, building C++ kernels the first time).
_START_TIMEOUT_S = 1800.0


class CoreClient(Protocol):
    limits: AdmissionLimits  # includes the KV cache's block count; set once wait_ready returns

    def wait_ready(self) -> list[tuple[str, float]]:
        """Wait until the model is loaded (the front end does its own set-up meanwhile); return the
        engine's start-up phases. Raises RuntimeError with the reason if the engine could not start."""
        ...

    def start(self, on_step: OnStep, on_dead: OnDead) -> None:
        """Start the loop; call inside the running event loop that gets the callbacks."""
        ...

    def add(self, seq: int, children: list[NewRequest]) -> None: ...

    def abort(self, req_ids: list[str], status: RequestStatus) -> None: ...

    def shutdown(self, timeout: float) -> None: ...

    def kill(self) -> None:
        """Stop a hung engine without waiting for its step: no callback comes after this."""
        ...


# ---------------------------------------------------------------------- thread
class ThreadCoreClient:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        from tokenmill.engine.engine_core import EngineCore  # torch and the model code: only where the core runs

        self.phases = StartupPhases(level=None)
        self.core = EngineCore(config, source, phases=self.phases)
        self.limits = self.core.scheduler.limits
        self._commands: queue.Queue[Command] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._sink: _LoopSink | None = None

    def wait_ready(self) -> list[tuple[str, float]]:
        return self.phases.phases  # loaded in __init__, on this thread

    def start(self, on_step: OnStep, on_dead: OnDead) -> None:
        from tokenmill.engine.core_loop import CoreLoop

        self._sink = _LoopSink(asyncio.get_running_loop(), on_step, on_dead)
        self._thread = threading.Thread(
            target=CoreLoop(self.core, _QueueCommands(self._commands), self._sink).run,
            name="tokenmill-engine",
            daemon=True,
        )
        self._thread.start()

    def add(self, seq: int, children: list[NewRequest]) -> None:
        self._commands.put(AddRequests(seq, children))

    def abort(self, req_ids: list[str], status: RequestStatus) -> None:
        self._commands.put(AbortRequests(req_ids, status))

    def shutdown(self, timeout: float) -> None:
        self._commands.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout)

    def kill(self) -> None:
        # A thread cannot be killed: it is left to stop by itself if its step ever returns, unheard.
        if self._sink is not None:
            self._sink.closed = True
        self._commands.put(Stop())


class _QueueCommands:
    def __init__(self, commands: queue.Queue[Command]) -> None:
        self.commands = commands

    def get(self, timeout: float) -> Command | None:
        try:
            return self.commands.get(timeout=timeout) if timeout > 0 else self.commands.get_nowait()
        except queue.Empty:
            return None


class _LoopSink:
    """Hands events to the event loop's thread, until closed (the engine was killed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_step: OnStep, on_dead: OnDead) -> None:
        self.loop, self.on_step, self.on_dead = loop, on_step, on_dead
        self.closed = False

    def publish(self, event: EngineStep | EngineDead) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the event loop has closed: nobody is left to tell
            pass

    def _deliver(self, event: EngineStep | EngineDead) -> None:
        if self.closed:  # checked on the event loop: nothing published before the kill arrives after it
            return
        if isinstance(event, EngineStep):
            self.on_step(event)
        else:
            self.on_dead(event.reason, event.failed)


# ---------------------------------------------------------------------- process
class ProcessCoreClient:
    """Spawns the engine process at once; wait_ready waits for its model to load."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold torch threads
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._events, events_out = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=run_engine_process,
            args=(config, source, commands_in, events_out, time.time()),
            name="tokenmill-engine",
            daemon=True,
        )
        with _engine_process_env():
            self.process.start()
        commands_in.close()
        events_out.close()
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write, name="tokenmill-engine-writer", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_step: OnStep | None = None
        self._on_dead: OnDead | None = None

    def wait_ready(self) -> list[tuple[str, float]]:
        waited = 0.0
        try:
            while not self._events.poll(1.0):
                waited += 1.0
                if not self.process.is_alive() or waited > _START_TIMEOUT_S:
                    raise EOFError
            event = EVENTS.decode(self._events.recv_bytes())
        except (EOFError, OSError):
            self.process.kill()
            self.process.join(10)
            raise RuntimeError(
                f"the engine process did not start (exit code {self.process.exitcode}); see its log above."
            ) from None
        if not isinstance(event, EngineReady):
            self.process.join(10)
            reason = event.reason if isinstance(event, (EngineStartFailed, EngineDead)) else repr(event)
            raise RuntimeError(f"the engine process could not start: {reason}")
        self.limits = event.limits
        return event.phases

    def start(self, on_step: OnStep, on_dead: OnDead) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_step, self._on_dead = on_step, on_dead
        self._writer.start()
        self._loop.add_reader(self._events.fileno(), self._read)

    def add(self, seq: int, children: list[NewRequest]) -> None:
        self._outbox.put(COMMANDS.encode(AddRequests(seq, children)))

    def abort(self, req_ids: list[str], status: RequestStatus) -> None:
        self._outbox.put(COMMANDS.encode(AbortRequests(req_ids, status)))

    def shutdown(self, timeout: float) -> None:
        self._outbox.put(COMMANDS.encode(Stop()))
        self._outbox.put(None)
        if self._writer.is_alive():
            self._writer.join(timeout)
        else:  # never started: write the stop here
            try:
                self._commands.send_bytes(COMMANDS.encode(Stop()))
            except OSError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def kill(self) -> None:
        self._stop_reading()
        self.process.kill()  # its tensor-parallel followers exit when its pipes close

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._commands.send_bytes(data)
            except OSError:  # the engine process is gone; the reader reports it
                return

    def _read(self) -> None:
        assert self._on_step is not None and self._on_dead is not None
        try:
            while self._events.poll():
                event = EVENTS.decode(self._events.recv_bytes())
                if isinstance(event, EngineDead):
                    self._stop_reading()
                    self._on_dead(event.reason, event.failed)
                    return
                if isinstance(event, EngineStep):
                    self._on_step(event)
        except (EOFError, OSError):
            self._stop_reading()
            self.process.join(5)
            self._on_dead(f"the engine process exited unexpectedly (exit code {self.process.exitcode}).", True)

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._events.fileno())


@contextlib.contextmanager
def _engine_process_env() -> Iterator[None]:
    """The environment the engine process starts with. OpenMP workers that spin while they wait take
    the CPU the server's event loop needs on a small machine (measured on 2 cores: serve at rate inf
    went from 0.85x to about offline speed), so they sleep instead unless the user chose otherwise.
    libgomp reads this when torch loads, before any of our code runs in the child, hence here."""
    added = "OMP_WAIT_POLICY" not in os.environ
    if added:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        if added:
            del os.environ["OMP_WAIT_POLICY"]


def run_engine_process(
    config: EngineConfig, source: ModelSource, commands: Connection, events: Connection, spawned_at: float
) -> None:
    """The engine process: load the model, send EngineReady, then run the core loop until told to stop.
    `spawned_at` (time.time() in the server) times this process's start: Python, torch and our imports."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which stops us in order
    # Imported here, not by the server process, whose path to this spawn imports no torch.
    from tokenmill.engine.core_loop import CoreLoop
    from tokenmill.engine.engine_core import EngineCore

    phases = StartupPhases(level=None)  # sent in EngineReady: the server logs them
    phases.record("imports", time.time() - spawned_at)
    configure_child_logging("engine", "tokenmill engine process: %(levelname)s %(message)s")
    try:
        core = EngineCore(config, source, phases=phases)
    except Exception as exc:
        logger.exception("loading the model failed")
        events.send_bytes(EVENTS.encode(EngineStartFailed(f"{type(exc).__name__}: {exc}")))
        return
    events.send_bytes(EVENTS.encode(EngineReady(core.scheduler.limits, phases.phases)))
    CoreLoop(core, _PipeCommands(commands), _PipeEvents(events)).run()


class _PipeCommands:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def get(self, timeout: float) -> Command | None:
        try:
            if not self.conn.poll(timeout):
                return None
            return COMMANDS.decode(self.conn.recv_bytes())
        except (EOFError, OSError):  # the server process is gone: stop
            return Stop()


class _PipeEvents:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def publish(self, event: EngineStep | EngineDead) -> None:
        try:
            self.conn.send_bytes(EVENTS.encode(event))
        except OSError:  # the server process is gone; the next command read says stop
            pass
