"""The msgpack wire between the server process and the engine process: what goes in comes out."""

from __future__ import annotations

import pytest

from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import AdmissionLimits
from tokenmill.engine import core_wire as wire
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequests,
    EngineDead,
    EngineReady,
    EngineSnapshot,
    EngineStartFailed,
    EngineStep,
    Event,
    RequestTimings,
    Stop,
)
from tokenmill.outputs import EngineCoreOutput, Logprob
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


def test_add_command_keeps_params_and_the_prefill_leader() -> None:
    params = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_k=5,
        seed=3,
        logit_bias={7: -2.5},
        stop=["\n\n"],
        stop_token_ids=[4],
        logprobs=2,
    )
    leader = Request("r#0", [1, 2, 3], params, frozenset({2, 0}), priority=-1, arrival_time=12.5)
    child = Request("r#1", [1, 2, 3], params, frozenset({2, 0}), priority=-1, prefill_leader=leader)
    command = wire.decode_command(wire.encode_command(AddRequests(7, [leader, child])))
    assert isinstance(command, AddRequests) and command.seq == 7
    children = command.requests
    assert [c.req_id for c in children] == ["r#0", "r#1"]
    assert children[1].prefill_leader is children[0] and children[0].prefill_leader is None
    assert children[0].sampling_params == params and children[0].sampling_params.logit_bias == {7: -2.5}
    assert children[0].eos_token_ids == frozenset({0, 2}) and children[0].arrival_time == 12.5
    assert children[0].priority == -1 and children[0].prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"b": {"maximum": 2**70}, "a": {}}}),
        StructuredOutputsParams(json='{"type": "array"}'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"\d+"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='start: "x"'),
    ],
)
def test_add_command_keeps_structured_outputs(spec: StructuredOutputsParams) -> None:
    params = SamplingParams(max_tokens=5, structured_outputs=spec)
    command = wire.decode_command(wire.encode_command(AddRequests(1, [Request("r", [1], params)])))
    assert isinstance(command, AddRequests)
    got = command.requests[0].sampling_params.structured_outputs
    assert got == spec and type(got.json) is type(spec.json)  # a dict schema comes back a dict, in order
    assert got.json is None or not isinstance(spec.json, dict) or list(got.json["properties"]) == ["b", "a"]


def test_abort_and_stop_commands() -> None:
    abort = AbortRequests(["a", "b"], RequestStatus.FINISHED_STOPPED)
    assert wire.decode_command(wire.encode_command(abort)) == abort
    assert wire.decode_command(wire.encode_command(Stop())) == Stop()


def test_step_event_keeps_outputs_logprobs_snapshot_and_timings() -> None:
    lps = {5: Logprob(-0.25, 1), 9: Logprob(-1.5, 2)}
    outputs = [
        EngineCoreOutput(
            "a", [5, 9], new_logprobs=[lps, {9: Logprob(-0.5, 1)}], new_prompt_logprobs=[None, {3: Logprob(-2.0, 4)}]
        ),
        EngineCoreOutput("b", [], finish_reason="stop", stop_reason=2, error=None),
        EngineCoreOutput("c", [], finish_reason="error", error="boom"),
    ]
    finished = Request("b", [1], SamplingParams())
    finished.first_scheduled_time, finished.first_token_time, finished.finished_time = 1.0, 2.0, 3.0
    finished.num_preemptions, finished.num_cached_tokens = 1, 16
    snapshot = EngineSnapshot(3, 1, 40, 0.25, 90, 2, 128, 64, 17, 5)
    step = EngineStep(outputs, snapshot, {"b": RequestTimings.of(finished)})
    data = wire.encode_event(step)
    assert wire.decode_event(data) == step
    assert b"num_running" not in data and b"first_token_time" not in data  # fields by position, no names
    copy = Request("b", [1], SamplingParams())
    step.timings["b"].apply_to(copy)
    assert (copy.first_scheduled_time, copy.first_token_time, copy.finished_time) == (1.0, 2.0, 3.0)
    assert (copy.num_preemptions, copy.num_cached_tokens) == (1, 16)


@pytest.mark.parametrize(
    "event",
    [
        EngineReady(AdmissionLimits(max_model_len=2048, block_size=16, num_blocks=300)),
        EngineStartFailed("OSError: no such model"),
        EngineDead("the engine was shut down.", False),
        EngineDead("a model step failed", True),
    ],
)
def test_lifecycle_events(event: Event) -> None:
    assert wire.decode_event(wire.encode_event(event)) == event


def test_an_unknown_tag_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown command"):
        wire.decode_command(wire.encode_event(EngineDead("x", True)))
    with pytest.raises(ValueError, match="unknown event"):
        wire.decode_event(wire.encode_command(Stop()))
