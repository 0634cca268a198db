"""What crosses the pipe between the server process and the engine process, as msgpack (never pickle).

Front end -> engine: commands (add, abort, stop). Engine -> front end: "ready" once the model is
loaded, "step" after every step (outputs + snapshot), "dead" when the loop ends. Each output
carries its request's core timings (queue, first token, preemptions), which the front end's copy
of the request lacks."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from tokenmill.core.request import Request, RequestStatus
from tokenmill.engine.core_loop import Command, EngineSnapshot
from tokenmill.outputs import EngineCoreOutput, Logprob, TokenLogprobs
from tokenmill.sampling_params import SamplingParams


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    # strict_map_key=False: logit_bias maps token ids (ints) to floats.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---------------------------------------------------------------------- commands
def encode_command(command: Command) -> bytes:
    if command[0] == "add":
        return pack(["add", command[1], [_encode_request(r) for r in command[2]]])
    if command[0] == "abort":
        return pack(["abort", list(command[1]), command[2].value])
    return pack(["stop"])


def decode_command(data: bytes) -> Command:
    message = unpack(data)
    if message[0] == "add":
        children: dict[str, Request] = {}
        for fields in message[2]:
            request = _decode_request(fields, children)
            children[request.req_id] = request
        return "add", message[1], list(children.values())
    if message[0] == "abort":
        return "abort", message[1], RequestStatus(message[2])
    return ("stop",)


def _encode_request(r: Request) -> list[Any]:
    leader = r.prefill_leader.req_id if r.prefill_leader is not None else None
    return [r.req_id, r.prompt_token_ids, dataclasses.asdict(r.sampling_params), sorted(r.eos_token_ids),
            r.priority, r.arrival_time, leader]


def _decode_request(fields: list[Any], siblings: dict[str, Request]) -> Request:
    req_id, ids, params, eos, priority, arrival, leader = fields
    return Request(req_id, ids, SamplingParams(**params), frozenset(eos), priority, arrival,
                   prefill_leader=siblings.get(leader) if leader is not None else None)


# ---------------------------------------------------------------------- events
def encode_step(outputs: list[EngineCoreOutput], snapshot: EngineSnapshot, requests: dict[str, Request]) -> bytes:
    """`requests`: the engine's requests by id, whose timings go along with their outputs."""
    return pack(["step", [_encode_output(o, requests.get(o.req_id)) for o in outputs], dataclasses.astuple(snapshot)])


def decode_step(message: list[Any]) -> tuple[list[tuple[EngineCoreOutput, list[Any] | None]], EngineSnapshot]:
    """The outputs, each with its request's timings (or None), and the snapshot."""
    return [_decode_output(o) for o in message[1]], EngineSnapshot(*message[2])


def apply_timings(request: Request, timings: list[Any]) -> None:
    (request.first_scheduled_time, request.first_token_time, request.finished_time, request.num_preemptions,
     request.num_cached_tokens) = timings


def _encode_output(o: EngineCoreOutput, r: Request | None) -> list[Any]:
    timings = None
    if r is not None:
        timings = [r.first_scheduled_time, r.first_token_time, r.finished_time, r.num_preemptions,
                   r.num_cached_tokens]
    prompt_lps = None if o.new_prompt_logprobs is None else [_encode_logprobs(e) for e in o.new_prompt_logprobs]
    return [o.req_id, o.new_token_ids, _encode_logprobs(o.new_logprobs), prompt_lps, o.finish_reason,
            o.stop_reason, o.error, timings]


def _decode_output(fields: list[Any]) -> tuple[EngineCoreOutput, list[Any] | None]:
    req_id, tokens, lps, prompt_lps, finish_reason, stop_reason, error, timings = fields
    prompt = None if prompt_lps is None else [_decode_logprobs(e) for e in prompt_lps]
    return EngineCoreOutput(req_id, tokens, _decode_logprobs(lps), prompt, finish_reason, stop_reason, error), timings


def _encode_logprobs(entry: TokenLogprobs | None) -> list[list[Any]] | None:
    return None if entry is None else [[tok, lp.logprob, lp.rank] for tok, lp in entry.items()]


def _decode_logprobs(entry: list[list[Any]] | None) -> TokenLogprobs | None:
    return None if entry is None else {tok: Logprob(logprob, rank) for tok, logprob, rank in entry}
