"""The messages between the front end (the server's event loop) and the engine core loop, one
msgspec Struct each (tokenmill.wire.Message). On a thread they are passed as they are; across
processes `COMMANDS` and `EVENTS` (tokenmill.wire.Codec) turn them into msgpack, field by name.

Front end -> engine (`Command`): AddRequests, AbortRequests, Stop.
Engine -> front end (`Event`): EngineReady (the model is loaded) or EngineStartFailed, then an
EngineStep after every step, and EngineDead once when the loop ends.

The front end holds no core `Request`: it sends a `NewRequest` (what the engine needs to build its
own), and the engine sends a request's `RequestTimings` back only when they change."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import EngineCoreOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams, params_for_wire
from tokenmill.scheduling.request import Request, RequestStatus
from tokenmill.scheduling.scheduler import AdmissionLimits
from tokenmill.wire import Codec, Message


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a model step failed, its process died, or it was shut down)."""


# ---------------------------------------------------------------------- commands
class NewRequest(Message):
    """One request (one sample of a user request) as the engine needs it to build its own `Request`."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    priority: int
    arrival_time: float  # time.monotonic() when the request was prepared
    prefill_leader_id: str | None  # the sibling that computes the shared prompt first (n > 1)
    cache_salt: str | None
    pooling_params: PoolingParams | None = None  # a pooling request (see pooling_params.py)
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    @classmethod
    def of(cls, request: Request) -> NewRequest:
        leader = request.prefill_leader
        return cls(
            request.req_id,
            request.prompt_token_ids,
            params_for_wire(request.sampling_params),
            request.eos_token_ids,
            request.priority,
            request.arrival_time,
            None if leader is None else leader.req_id,
            request.cache_salt,
            request.pooling_params,
            request.lora_request,
        )

    @property
    def max_tokens(self) -> int:
        # The input processor resolves None before a request is sent; a pooling request generates nothing.
        return 0 if self.pooling_params is not None else self.sampling_params.max_tokens or 0


def build_requests(specs: list[NewRequest]) -> list[Request]:
    """Fresh, never-scheduled Requests for one user request's samples; leaders point into the list."""
    built: dict[str, Request] = {}
    for spec in specs:
        built[spec.req_id] = Request(
            spec.req_id,
            spec.prompt_token_ids,
            spec.sampling_params,
            spec.eos_token_ids,
            spec.priority,
            spec.arrival_time,
            prefill_leader=None if spec.prefill_leader_id is None else built.get(spec.prefill_leader_id),
            cache_salt=spec.cache_salt,
            pooling_params=spec.pooling_params,
            lora_request=spec.lora_request,
        )
    return list(built.values())


class AddRequests(Message):
    """Queue requests (the children of one user request). `seq` numbers the adds, so the front end
    can tell from a snapshot's `last_add_seq` which of its adds the engine has counted."""

    seq: int
    requests: list[NewRequest]


class AbortRequests(Message):
    """End requests before the next step, with `status` (aborted, or stopped by a stop string)."""

    req_ids: list[str]
    status: RequestStatus


class Stop(Message):
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
    kv_tier: KVTierStats | None = None  # the second KV tier's counters (a copy), None without a tier

    @classmethod
    def idle(cls, num_free_blocks: int) -> EngineSnapshot:
        """An engine with nothing to do and every KV block free."""
        return cls(0, 0, 0, 0.0, num_free_blocks, 0, 0, 0, 0, 0)


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


class EngineReady(Message):
    """The model is loaded; what every request must fit, and how long each start-up phase took in the
    engine process (startup_phases.py), for the server to log."""

    limits: AdmissionLimits
    phases: list[tuple[str, float]]


class EngineStartFailed(Message):
    """Loading the model failed; the engine process has exited."""

    reason: str


class EngineStep(Message):
    """What one step (or a batch of commands that needed none) changed, and the state after it.
    `timings`: by req_id, the core timings of the outputs' requests whose timings changed since the
    engine last sent them (first scheduled, first token, finished, preempted, drafts verified)."""

    outputs: list[EngineCoreOutput]
    snapshot: EngineSnapshot
    timings: dict[str, RequestTimings] = {}


class EngineDead(Message):
    """The loop has ended: `failed` after an error, else a shutdown."""

    reason: str
    failed: bool


Event = EngineReady | EngineStartFailed | EngineStep | EngineDead

COMMANDS: Codec[Command] = Codec(Command, "command on the engine pipe")
EVENTS: Codec[Event] = Codec(Event, "event on the engine pipe")
