"""The commands rank 0 sends its followers, one dataclass per command, as msgpack (never pickle).

Each message is one msgpack array: a tag, then the fields by position. The step command carries the
whole SchedulerOutput, so every rank updates the same request states and runs the same step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from tokenmill.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.sampling_params import params_from_wire, params_to_wire

Fields = list[Any]  # a decoded msgpack value; the decoders below give it its shape


@dataclass(frozen=True)
class ExecuteStep:
    sched: SchedulerOutput


@dataclass(frozen=True)
class AllocateKVCache:
    num_blocks: int


@dataclass(frozen=True)
class ProfileRun:
    pass


@dataclass(frozen=True)
class CaptureCudaGraphs:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


WorkerCommand = ExecuteStep | AllocateKVCache | ProfileRun | CaptureCudaGraphs | Shutdown


def encode_command(command: WorkerCommand) -> bytes:
    if isinstance(command, ExecuteStep):
        message: Fields = ["step", *_encode_sched(command.sched)]
    elif isinstance(command, AllocateKVCache):
        message = ["alloc", command.num_blocks]
    elif isinstance(command, ProfileRun):
        message = ["profile"]
    elif isinstance(command, CaptureCudaGraphs):
        message = ["graphs"]
    else:
        message = ["shutdown"]
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


def decode_command(data: bytes) -> WorkerCommand:
    # strict_map_key=False: num_scheduled_tokens has str keys, logit_bias int keys.
    message: Fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    tag, fields = message[0], message[1:]
    if tag == "step":
        return ExecuteStep(_decode_sched(fields))
    if tag == "alloc":
        return AllocateKVCache(fields[0])
    if tag == "profile":
        return ProfileRun()
    if tag == "graphs":
        return CaptureCudaGraphs()
    if tag == "shutdown":
        return Shutdown()
    raise ValueError(f"unknown command {tag!r} from rank 0")


def _encode_sched(s: SchedulerOutput) -> Fields:
    new = [
        [r.req_id, r.prompt_token_ids, r.output_token_ids, params_to_wire(r.sampling_params), r.block_ids,
         r.num_computed_tokens]
        for r in s.new_requests
    ]  # fmt: skip
    cached = [[r.req_id, r.new_block_ids, r.num_computed_tokens] for r in s.cached_requests]
    return [
        new,
        cached,
        s.num_scheduled_tokens,
        s.total_num_scheduled_tokens,
        sorted(s.finished_req_ids),
        s.scheduled_spec_tokens,
    ]


def _decode_sched(fields: Fields) -> SchedulerOutput:
    new, cached, num_scheduled, total, finished, spec = fields
    return SchedulerOutput(
        new_requests=[
            NewRequestData(req_id, prompt, output, params_from_wire(params), blocks, computed)
            for req_id, prompt, output, params, blocks, computed in new
        ],
        cached_requests=[CachedRequestData(*r) for r in cached],
        num_scheduled_tokens=num_scheduled,  # msgpack keeps the map's order: the batch's row order
        total_num_scheduled_tokens=total,
        finished_req_ids=set(finished),
        scheduled_spec_tokens=spec,
    )
