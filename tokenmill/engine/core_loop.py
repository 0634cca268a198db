"""The engine core's busy loop: apply commands (add, abort, stop) between steps, step, publish.

The same loop runs on a thread of the server process or in an engine process of its own; only
where commands come from and where step results go differ (see core_client.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.core.request import Request, RequestStatus
from tokenmill.engine.engine_core import EngineCore
from tokenmill.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)

# How long the idle loop waits for a command before it looks again.
IDLE_POLL_S = 0.5

# ("add", seq, [Request, ...]) | ("abort", [req_id, ...], RequestStatus) | ("stop",)
Command = tuple[Any, ...]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a model step failed, its process died, or it was shut down)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state right after a step (or after commands that needed no step)."""

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


class CommandSource(Protocol):
    def get(self, timeout: float) -> Command | None:
        """The next command, waiting up to `timeout` seconds (0: do not wait); None if there is none."""
        ...


class EventSink(Protocol):
    def step(self, outputs: list[EngineCoreOutput], snapshot: EngineSnapshot) -> None: ...

    def dead(self, reason: str, failed: bool) -> None: ...


class CoreLoop:
    def __init__(self, core: EngineCore, commands: CommandSource, events: EventSink) -> None:
        self.core, self.commands, self.events = core, commands, events
        self.last_seq = 0

    def run(self) -> None:
        core = self.core
        try:
            while True:
                stop, applied, rejected = self._apply_commands(wait=not core.has_unfinished())
                if stop:
                    self.events.dead("the engine was shut down.", False)
                    return
                if not core.has_unfinished():
                    if applied:  # aborts or rejected adds changed the state: say so without a step
                        self.events.step(rejected, self._snapshot(0))
                    continue
                failed_before = core.num_failed_steps
                tokens_before = core.scheduler.stats.num_scheduled_tokens
                outputs = rejected + core.step()
                self.events.step(outputs, self._snapshot(core.scheduler.stats.num_scheduled_tokens - tokens_before))
                if core.num_failed_steps > failed_before:
                    raise EngineDeadError("a model step failed; the engine stopped (see the server log).")
        except BaseException as exc:  # the loop must never die silently
            if not isinstance(exc, EngineDeadError):
                logger.exception("the engine loop failed")
            reason = str(exc) if isinstance(exc, EngineDeadError) else "the engine loop failed (see the server log)."
            self.events.dead(reason, True)

    def _apply_commands(self, wait: bool) -> tuple[bool, bool, list[EngineCoreOutput]]:
        """Apply every queued command; returns (stop?, applied any?, outputs for rejected adds)."""
        rejected: list[EngineCoreOutput] = []
        command = self.commands.get(IDLE_POLL_S if wait else 0.0)
        applied = command is not None
        while command is not None:
            if command[0] == "stop":
                return True, applied, rejected
            if command[0] == "add":
                self.last_seq = command[1]
                rejected += self._add(command[2])
            else:
                for req_id in command[1]:
                    self.core.abort_request(req_id, command[2])
            command = self.commands.get(0.0)
        return False, applied, rejected

    def _add(self, children: list[Request]) -> list[EngineCoreOutput]:
        rejected = []
        for child in children:
            try:
                self.core.add_request(child)
            except ValueError as exc:  # validated already; never let one request stop the loop
                child.status = RequestStatus.FINISHED_ERROR
                rejected.append(EngineCoreOutput(child.req_id, [], finish_reason="error", error=str(exc)))
        return rejected

    def _snapshot(self, num_step_tokens: int) -> EngineSnapshot:
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
            last_add_seq=self.last_seq,
        )
