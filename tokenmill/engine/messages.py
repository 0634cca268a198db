"""The messages between the front end (the server's event loop) and the engine core loop, one
frozen dataclass each. On a thread they are passed as they are; across processes core_wire.py
turns them into msgpack.

Front end -> engine (`Command`): AddRequests, AbortRequests, Stop.
Engine -> front end (`Event`): EngineReady (the model is loaded) or EngineStartFailed, then an
EngineStep after every step, and EngineDead once when the loop ends."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import AdmissionLimits
from tokenmill.outputs import EngineCoreOutput


# ---------------------------------------------------------------------- commands
@dataclass(frozen=True)
class AddRequests:
    """Queue requests (the children of one user request). `seq` numbers the adds, so the front end
    can tell from a snapshot's `last_add_seq` which of its adds the engine has counted."""

    seq: int
    requests: list[Request]


@dataclass(frozen=True)
class AbortRequests:
    """End requests before the next step, with `status` (aborted, or stopped by a stop string)."""

    req_ids: list[str]
    status: RequestStatus


@dataclass(frozen=True)
class Stop:
    """Shut the loop down after its current step."""


Command = AddRequests | AbortRequests | Stop


# ---------------------------------------------------------------------- events
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
    # Speculative decoding, cumulative (SpecDecodingStats): request-steps that verified drafts, draft
    # tokens verified, drafts accepted, and [i] drafts whose token at position i was accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    num_cached_free_blocks: int = 0  # free blocks that still hold a cached prefix
    # This step's shape (engine_core.StepShape): wall seconds, decode rows, prompt tokens, estimated bytes
    # read from memory; 0 without a step.
    step_seconds: float = 0.0
    step_decode_rows: int = 0
    step_prefill_tokens: int = 0
    step_bytes_read: int = 0

    def __post_init__(self) -> None:
        # The pipe (msgpack) hands back a list; keep the frozen snapshot's tuple.
        object.__setattr__(self, "spec_accepted_per_pos", tuple(self.spec_accepted_per_pos))


@dataclass(frozen=True)
class RequestTimings:
    """A request's core timings, which only the engine's copy of the request records."""

    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    num_cached_tokens: int
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for the request, and accepted
    num_accepted_tokens: int = 0

    @classmethod
    def of(cls, request: Request) -> RequestTimings:
        return cls(
            request.first_scheduled_time,
            request.first_token_time,
            request.finished_time,
            request.num_preemptions,
            request.num_cached_tokens,
            request.num_draft_tokens,
            request.num_accepted_tokens,
        )

    def apply_to(self, request: Request) -> None:
        request.first_scheduled_time = self.first_scheduled_time
        request.first_token_time = self.first_token_time
        request.finished_time = self.finished_time
        request.num_preemptions = self.num_preemptions
        request.num_cached_tokens = self.num_cached_tokens
        request.num_draft_tokens = self.num_draft_tokens
        request.num_accepted_tokens = self.num_accepted_tokens


@dataclass(frozen=True)
class EngineReady:
    """The model is loaded; what every request must fit."""

    limits: AdmissionLimits


@dataclass(frozen=True)
class EngineStartFailed:
    """Loading the model failed; the engine process has exited."""

    reason: str


@dataclass(frozen=True)
class EngineStep:
    """What one step (or a batch of commands that needed none) changed, and the state after it.
    `timings`: the core timings of the outputs' requests by req_id, filled in only where the front
    end holds copies of the requests (an engine process); on a thread the requests are shared."""

    outputs: list[EngineCoreOutput]
    snapshot: EngineSnapshot
    timings: dict[str, RequestTimings] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineDead:
    """The loop has ended: `failed` after an error, else a shutdown."""

    reason: str
    failed: bool


Event = EngineReady | EngineStartFailed | EngineStep | EngineDead
