"""The typed wire (tokenmill.wire) between the server and engine processes and between tensor-parallel
ranks: every field of every message comes back by name, and bytes of another layout are refused."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec
import pytest

from tokenmill.engine.messages import (
    COMMANDS,
    EVENTS,
    AbortRequests,
    AddRequests,
    EngineDead,
    EngineReady,
    EngineSnapshot,
    EngineStartFailed,
    EngineStep,
    Event,
    NewRequest,
    RequestTimings,
    Stop,
    build_requests,
)
from tokenmill.executor.messages import (
    RANK_REPLIES,
    WORKER_COMMANDS,
    AllocateKVCache,
    ExecuteStep,
    RankFailed,
    RankReady,
    RankStarted,
    Shutdown,
    WorkerCommand,
)
from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import CachedRequestData, EngineCoreOutput, Logprob, NewRequestData, SchedulerOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.scheduling.request import Request, RequestStatus
from tokenmill.scheduling.scheduler import AdmissionLimits
from tokenmill.wire import WireError

_EMPTY: tuple[object, ...] = (None, 0, "", (), [], {})


def _defaults(obj: Any) -> dict[str, Any]:
    """Each field's default value (the empty values for a field without one)."""
    if isinstance(obj, msgspec.Struct):
        info = msgspec.structs.fields(obj)
        return {f.name: f.default if f.default is not msgspec.NODEFAULT else _EMPTY for f in info}
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
        else:
            defaults[f.name] = _EMPTY
    return defaults


def _assert_every_field_set(obj: Any) -> None:
    """No field at its default (or empty): a field added later fails here until the test sets it."""
    unset = []
    for name, default in _defaults(obj).items():
        value = getattr(obj, name)
        if value in default if default is _EMPTY else value == default:
            unset.append(name)
    assert not unset, f"{type(obj).__name__} leaves {unset} unset: set them so the round trip covers them"


PARAMS = SamplingParams(
    n=2,
    max_tokens=9,
    min_tokens=1,
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    min_p=0.05,
    seed=3,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    logit_bias={7: -2.5},
    stop=["\n\n"],
    stop_token_ids=[4],
    ignore_eos=True,
    logprobs=2,
    prompt_logprobs=1,
    skip_special_tokens=False,
    include_stop_str_in_output=True,
    structured_outputs=StructuredOutputsParams(regex=r"\d+"),
)


# ---------------------------------------------------------------------- engine commands
def test_an_add_command_keeps_every_field_and_the_prefill_leader() -> None:
    _assert_every_field_set(PARAMS)
    pooling = PoolingParams("classify", "MEAN", normalize=False)
    lora = LoRARequest("sql", 3, "/adapters/sql")
    leader = Request("r#0", [1, 2, 3], PARAMS, frozenset({2, 9}), -1, 12.5, cache_salt="s", pooling_params=pooling)
    child = Request("r#1", [1, 2, 3], PARAMS, frozenset({2, 9}), -1, 12.5, leader, "s", pooling, lora)
    sent = AddRequests(7, [NewRequest.of(leader), NewRequest.of(child)])
    _assert_every_field_set(sent)
    _assert_every_field_set(sent.requests[1])
    decoded = COMMANDS.decode(COMMANDS.encode(sent))
    assert decoded == sent
    built = build_requests(decoded.requests) if isinstance(decoded, AddRequests) else []
    assert [r.req_id for r in built] == ["r#0", "r#1"]
    assert built[1].prefill_leader is built[0] and built[0].prefill_leader is None
    assert built[0].sampling_params == PARAMS and built[0].eos_token_ids == frozenset({2, 9})
    assert built[1].pooling_params == pooling and built[1].lora_request == lora


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(json='{"type": "array"}'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"\d+"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='start: "x"'),
    ],
)
def test_structured_outputs_cross_as_they_are(spec: StructuredOutputsParams) -> None:
    add = AddRequests(1, [NewRequest.of(Request("r", [1], SamplingParams(max_tokens=5, structured_outputs=spec)))])
    decoded = COMMANDS.decode(COMMANDS.encode(add))
    assert isinstance(decoded, AddRequests) and decoded.requests[0].sampling_params.structured_outputs == spec


def test_a_dict_schema_crosses_as_its_json_text_in_order_with_integers_past_64_bits() -> None:
    schema = {"type": "object", "properties": {"b": {"maximum": 2**70}, "a": {}}}
    params = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json=schema))
    decoded = COMMANDS.decode(COMMANDS.encode(AddRequests(1, [NewRequest.of(Request("r", [1], params))])))
    assert isinstance(decoded, AddRequests)
    got = decoded.requests[0].sampling_params.structured_outputs
    assert got is not None and isinstance(got.json, str)
    assert json.loads(got.json) == schema and list(json.loads(got.json)["properties"]) == ["b", "a"]


def test_abort_and_stop_commands() -> None:
    abort = AbortRequests(["a", "b"], RequestStatus.FINISHED_STOPPED)
    assert COMMANDS.decode(COMMANDS.encode(abort)) == abort
    assert COMMANDS.decode(COMMANDS.encode(Stop())) == Stop()


# ---------------------------------------------------------------------- engine events
def test_a_step_event_keeps_every_field_by_name() -> None:
    output = EngineCoreOutput(
        "a",
        [5, 9],
        new_logprobs=[{5: Logprob(-0.25, 1, "x")}, {9: Logprob(-0.5, 1, "y")}],
        new_prompt_logprobs=[None, {3: Logprob(-2.0, 4, "z")}],
        finish_reason="stop",
        stop_reason=2,
        error="boom",
        pooled=[0.5, -0.25],
    )
    tier = KVTierStats(100, 40, 64, 4, 1, 50, 2, 1 << 33, 1 << 32, 0.125, 3)
    snapshot = EngineSnapshot(3, 1, 40, 0.25, 90, 2, 128, 64, 17, 5, 4, 20, 10, (4, 3), 6, 0.01, 2, 30, 1 << 40, tier)
    timings = RequestTimings(1.0, 2.0, 3.0, 1, 16, 12, 7)
    step = EngineStep([output], snapshot, {"a": timings})
    for part in (output, snapshot, tier, timings, step):
        _assert_every_field_set(part)
    data = EVENTS.encode(step)
    assert EVENTS.decode(data) == step
    assert b"num_running" in data and b"first_token_time" in data  # fields by name, never by position


@pytest.mark.parametrize(
    "event",
    [
        EngineReady(AdmissionLimits(max_model_len=2048, block_size=16, num_blocks=300), [("model", 0.4)]),
        EngineStartFailed("OSError: no such model"),
        EngineDead("the engine was shut down.", False),
        EngineDead("a model step failed", True),
    ],
)
def test_lifecycle_events(event: Event) -> None:
    assert EVENTS.decode(EVENTS.encode(event)) == event


# ---------------------------------------------------------------------- refusals
def test_a_message_of_another_union_is_refused() -> None:
    with pytest.raises(WireError, match="command on the engine pipe"):
        COMMANDS.decode(EVENTS.encode(EngineDead("x", True)))
    with pytest.raises(WireError, match="event on the engine pipe"):
        EVENTS.decode(COMMANDS.encode(Stop()))


def test_a_missing_field_is_refused_with_its_path() -> None:
    message = msgspec.to_builtins(EngineStartFailed("x"))
    del message["reason"]
    with pytest.raises(WireError, match="reason"):
        EVENTS.decode(msgspec.msgpack.encode(message))


def test_a_renamed_field_is_refused() -> None:
    message = msgspec.to_builtins(EngineDead("x", True))
    message["dead_reason"] = message.pop("reason")  # a writer that renamed the field
    with pytest.raises(WireError, match="dead_reason|reason"):
        EVENTS.decode(msgspec.msgpack.encode(message))
    limits = msgspec.to_builtins(EngineReady(AdmissionLimits(2048, 16, 300), []))
    limits["limits"]["blocks"] = limits["limits"].pop("num_blocks")  # inside a contract dataclass
    with pytest.raises(WireError, match="num_blocks"):
        EVENTS.decode(msgspec.msgpack.encode(limits))


# ---------------------------------------------------------------------- tensor-parallel ranks
def test_a_step_command_keeps_every_field_and_the_batch_order() -> None:
    new = NewRequestData(
        "b", [1, 2], [3], PARAMS, [4, 5], 2, [[0, 8]], PoolingParams("embed", "CLS"), LoRARequest("a", 1, "/a")
    )
    cached = CachedRequestData("a", [6], 9, [[10]])
    sched = SchedulerOutput(
        [new],
        [cached],
        {"b": 1, "a": 2},
        3,
        {"gone"},
        {"a": [7]},
        [(4, b"\x01" * 32)],
        [(5, b"\x02" * 32)],
        [b"\x03" * 32],
    )
    for part in (new, cached, sched):
        _assert_every_field_set(part)
    decoded = WORKER_COMMANDS.decode(WORKER_COMMANDS.encode(ExecuteStep(sched)))
    assert decoded == ExecuteStep(sched)
    assert isinstance(decoded, ExecuteStep) and list(decoded.sched.num_scheduled_tokens) == ["b", "a"]


@pytest.mark.parametrize("command", [AllocateKVCache(300), Shutdown()])
def test_other_rank_commands(command: WorkerCommand) -> None:
    assert WORKER_COMMANDS.decode(WORKER_COMMANDS.encode(command)) == command


def test_a_ranks_reply() -> None:
    assert RANK_REPLIES.decode(RANK_REPLIES.encode(RankStarted())) == RankStarted()
    assert RANK_REPLIES.decode(RANK_REPLIES.encode(RankReady())) == RankReady()
    assert RANK_REPLIES.decode(RANK_REPLIES.encode(RankFailed("OSError"))) == RankFailed("OSError")
    with pytest.raises(WireError):
        RANK_REPLIES.decode(WORKER_COMMANDS.encode(Shutdown()))
