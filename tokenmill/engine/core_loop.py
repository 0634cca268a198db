"""The engine core's busy loop: apply commands (add, abort, stop) between steps, step, publish.

The same loop runs on a thread of the server process or in an engine process of its own; only
where commands come from and where step results go differ (see core_client.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from tokenmill.engine.engine_core import EngineCore, StepShape
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequests,
    Command,
    EngineDead,
    EngineDeadError,
    EngineSnapshot,
    EngineStep,
    NewRequest,
    RequestTimings,
    Stop,
    build_requests,
)
from tokenmill.outputs import EngineCoreOutput
from tokenmill.scheduling.request import Request, RequestStatus

__all__ = ["CommandSource", "CoreLoop", "EngineSnapshot", "EventSink"]

logger = logging.getLogger(__name__)

# How long the idle loop waits for a command before it looks again.
IDLE_POLL_S = 0.5
# A failed model step ends the requests in it and the loop goes on; this many failures in a row
# mean the model runner itself is broken (a lost device, corrupted state), so the loop ends and
# the front end starts a new engine.
MAX_FAILED_STEPS_IN_A_ROW = 3


class CommandSource(Protocol):
    def get(self, timeout: float) -> Command | None:
        """The next command, waiting up to `timeout` seconds (0: do not wait); None if there is none."""
        ...


class EventSink(Protocol):
    def publish(self, event: EngineStep | EngineDead) -> None:
        """Hand an event to the front end; never blocks the loop for long."""
        ...


class CoreLoop:
    def __init__(self, core: EngineCore, commands: CommandSource, events: EventSink) -> None:
        self.core, self.commands, self.events = core, commands, events
        self.last_seq = 0
        # The live requests, and the timings last sent for each: the front end holds no Request, so
        # a step sends a request's timings only when they have changed.
        self.live: dict[str, Request] = {}
        self.sent_timings: dict[str, RequestTimings] = {}

    def run(self) -> None:
        core = self.core
        failed_in_a_row = 0
        try:
            while True:
                stop, applied, rejected = self._apply_commands(wait=not core.has_unfinished())
                if stop:
                    core.shutdown()  # the other tensor-parallel ranks exit with it
                    self.events.publish(EngineDead("the engine was shut down.", False))
                    return
                if not core.has_unfinished():
                    if applied:  # aborts or rejected adds changed the state: say so without a step
                        self._publish(rejected, 0, StepShape())
                    continue
                failed_before = core.num_failed_steps
                tokens_before = core.scheduler.stats.num_scheduled_tokens
                outputs = rejected + core.step()
                # The shape of the step this call collected (with async scheduling, launched a call earlier).
                self._publish(outputs, core.scheduler.stats.num_scheduled_tokens - tokens_before, core.last_step)
                if core.dead_reason is not None:  # a tensor-parallel rank died: restart now, not at the next step
                    raise EngineDeadError(core.dead_reason)
                failed_in_a_row = failed_in_a_row + 1 if core.num_failed_steps > failed_before else 0
                if failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                    raise EngineDeadError(f"{failed_in_a_row} model steps in a row failed (see the server log).")
        except BaseException as exc:  # the loop must never die silently
            if not isinstance(exc, EngineDeadError):
                logger.exception("the engine loop failed")
            reason = str(exc) if isinstance(exc, EngineDeadError) else "the engine loop failed (see the server log)."
            core.shutdown()
            self.events.publish(EngineDead(reason, True))

    def _apply_commands(self, wait: bool) -> tuple[bool, bool, list[EngineCoreOutput]]:
        """Apply every queued command; returns (stop?, applied any?, outputs for rejected adds)."""
        rejected: list[EngineCoreOutput] = []
        command = self.commands.get(IDLE_POLL_S if wait else 0.0)
        applied = command is not None
        while command is not None:
            if isinstance(command, Stop):
                return True, applied, rejected
            if isinstance(command, AddRequests):
                self.last_seq = command.seq
                rejected += self._add(command.requests)
            elif isinstance(command, AbortRequests):
                for req_id in command.req_ids:
                    self.core.abort_request(req_id, command.status)
                    self._forget(req_id)
            command = self.commands.get(0.0)
        return False, applied, rejected

    def _add(self, specs: list[NewRequest]) -> list[EngineCoreOutput]:
        rejected = []
        for child in build_requests(specs):
            try:
                self.core.add_request(child)
            except ValueError as exc:  # validated already; never let one request stop the loop
                child.status = RequestStatus.FINISHED_ERROR
                rejected.append(EngineCoreOutput(child.req_id, [], finish_reason="error", error=str(exc)))
            else:
                self.live[child.req_id] = child
        return rejected

    def _publish(self, outputs: list[EngineCoreOutput], num_step_tokens: int, shape: StepShape) -> None:
        self.events.publish(EngineStep(outputs, self._snapshot(num_step_tokens, shape), self._changed_timings(outputs)))

    def _changed_timings(self, outputs: list[EngineCoreOutput]) -> dict[str, RequestTimings]:
        """The timings of the outputs' requests that differ from those last sent (a request's first
        token, its finish, a preemption, drafts verified); a finished request is forgotten."""
        changed: dict[str, RequestTimings] = {}
        for output in outputs:
            request = self.live.get(output.req_id)
            if request is None:
                continue
            timings = RequestTimings.of(request)
            if timings != self.sent_timings.get(output.req_id):
                changed[output.req_id] = self.sent_timings[output.req_id] = timings
            if output.finished:
                self._forget(output.req_id)
        return changed

    def _forget(self, req_id: str) -> None:
        self.live.pop(req_id, None)
        self.sent_timings.pop(req_id, None)

    def _snapshot(self, num_step_tokens: int, shape: StepShape) -> EngineSnapshot:
        sched, kv = self.core.scheduler, self.core.kv_cache
        spec = sched.stats.spec
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
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(spec.accepted_per_pos),
            num_cached_free_blocks=kv.pool.num_cached_free_blocks,
            step_seconds=shape.seconds,
            step_decode_rows=shape.decode_rows,
            step_prefill_tokens=shape.prefill_tokens,
            step_bytes_read=shape.bytes_read,
            kv_tier=dataclasses.replace(tier) if (tier := self.core.kv_tier_stats) is not None else None,
        )
