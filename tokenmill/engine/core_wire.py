"""The messages of messages.py as msgpack (never pickle), for the pipe between the server process
and the engine process.

Each message is one msgpack array: a short tag, then its fields by position (no field names on the
wire). A step's outputs each carry their request's core timings (queue, first token, preemptions),
which the front end's copy of the request lacks."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import AdmissionLimits
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequests,
    Command,
    EngineDead,
    EngineReady,
    EngineSnapshot,
    EngineStartFailed,
    EngineStep,
    Event,
    RequestTimings,
    Stop,
)
from tokenmill.outputs import EngineCoreOutput, Logprob, TokenLogprobs
from tokenmill.sampling_params import params_from_wire, params_to_wire

# A decoded msgpack value: Any is honest here, the decoders below give it its shape.
Fields = list[Any]


def _pack(message: Fields) -> bytes:
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


def _unpack(data: bytes) -> Fields:
    # strict_map_key=False: logit_bias maps token ids (ints) to floats.
    message: Fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return message


# ---------------------------------------------------------------------- commands
def encode_command(command: Command) -> bytes:
    if isinstance(command, AddRequests):
        return _pack(["add", command.seq, [_encode_request(r) for r in command.requests]])
    if isinstance(command, AbortRequests):
        return _pack(["abort", list(command.req_ids), command.status.value])
    return _pack(["stop"])


def decode_command(data: bytes) -> Command:
    message = _unpack(data)
    tag = message[0]
    if tag == "add":
        children: dict[str, Request] = {}
        for fields in message[2]:
            request = _decode_request(fields, children)
            children[request.req_id] = request
        return AddRequests(message[1], list(children.values()))
    if tag == "abort":
        return AbortRequests(message[1], RequestStatus(message[2]))
    if tag == "stop":
        return Stop()
    raise ValueError(f"unknown command {tag!r} on the engine pipe")


def _encode_request(r: Request) -> Fields:
    leader = r.prefill_leader.req_id if r.prefill_leader is not None else None
    return [
        r.req_id,
        r.prompt_token_ids,
        params_to_wire(r.sampling_params),
        sorted(r.eos_token_ids),
        r.priority,
        r.arrival_time,
        leader,
        r.cache_salt,
    ]


def _decode_request(fields: Fields, siblings: dict[str, Request]) -> Request:
    req_id, ids, params, eos, priority, arrival, leader, cache_salt = fields
    return Request(
        req_id,
        ids,
        params_from_wire(params),
        frozenset(eos),
        priority,
        arrival,
        prefill_leader=siblings.get(leader) if leader is not None else None,
        cache_salt=cache_salt,
    )


# ---------------------------------------------------------------------- events
def encode_event(event: Event) -> bytes:
    if isinstance(event, EngineStep):
        outputs = [_encode_output(o, event.timings.get(o.req_id)) for o in event.outputs]
        return _pack(["step", outputs, dataclasses.astuple(event.snapshot)])
    if isinstance(event, EngineReady):
        return _pack(["ready", dataclasses.astuple(event.limits)])
    if isinstance(event, EngineStartFailed):
        return _pack(["start_failed", event.reason])
    return _pack(["dead", event.reason, event.failed])


def decode_event(data: bytes) -> Event:
    message = _unpack(data)
    tag = message[0]
    if tag == "step":
        outputs, timings = [], {}
        for fields in message[1]:
            output, timing = _decode_output(fields)
            outputs.append(output)
            if timing is not None:
                timings[output.req_id] = timing
        return EngineStep(outputs, EngineSnapshot(*message[2]), timings)
    if tag == "ready":
        return EngineReady(AdmissionLimits(*message[1]))
    if tag == "start_failed":
        return EngineStartFailed(message[1])
    if tag == "dead":
        return EngineDead(message[1], message[2])
    raise ValueError(f"unknown event {tag!r} on the engine pipe")


def _encode_output(o: EngineCoreOutput, timings: RequestTimings | None) -> Fields:
    prompt_lps = None if o.new_prompt_logprobs is None else [_encode_logprobs(e) for e in o.new_prompt_logprobs]
    lps = None if o.new_logprobs is None else [_encode_logprobs(e) for e in o.new_logprobs]
    return [
        o.req_id,
        o.new_token_ids,
        lps,
        prompt_lps,
        o.finish_reason,
        o.stop_reason,
        o.error,
        None if timings is None else dataclasses.astuple(timings),
    ]


def _decode_output(fields: Fields) -> tuple[EngineCoreOutput, RequestTimings | None]:
    req_id, tokens, lps, prompt_lps, finish_reason, stop_reason, error, timings = fields
    prompt = None if prompt_lps is None else [_decode_logprobs(e) for e in prompt_lps]
    new_lps = None if lps is None else [e for e in map(_decode_logprobs, lps) if e is not None]
    output = EngineCoreOutput(req_id, tokens, new_lps, prompt, finish_reason, stop_reason, error)
    return output, None if timings is None else RequestTimings(*timings)


def _encode_logprobs(entry: TokenLogprobs | None) -> list[Fields] | None:
    return None if entry is None else [[tok, lp.logprob, lp.rank] for tok, lp in entry.items()]


def _decode_logprobs(entry: list[Fields] | None) -> TokenLogprobs | None:
    return None if entry is None else {tok: Logprob(logprob, rank) for tok, logprob, rank in entry}
