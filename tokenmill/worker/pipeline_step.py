"""One step on a pipeline stage: its decoder layers on the step's requests, activations received from the
previous stage and sent to the next; the last stage samples and sends its output to every rank (so
every rank's request states stay in lockstep, as under tensor parallelism).

Stages overlap across steps (vLLM's virtual engines): a step is launched (each stage runs its layers on
it, the last samples) and finished (a rank takes the output) apart, and the engine keeps up to P steps
in flight, each with about 1/P of the requests and none of another's (engine/engine_core.py), so stage
s runs step N + 1 while stage s + 1 runs step N. Activations and outputs go point to point with
non-blocking sends: no stage waits for another to be ready to take them (a collective here would make
the last stage wait for the first to finish its next step before starting its own)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from tokenmill.distributed.communication import (
    recv_from_prev_stage,
    recv_output_of_last_stage,
    send_output_from_last_stage,
    send_to_next_stage,
)
from tokenmill.distributed.parallel_state import get_pp_stage
from tokenmill.outputs import ModelRunnerOutput
from tokenmill.worker.block_table import BlockTables
from tokenmill.worker.input_batch import RunnerRequestState, StepBatch, build_step_batch

Outputs = Callable[[torch.Tensor, StepBatch, list[RunnerRequestState], bool], ModelRunnerOutput]


@dataclass
class StageTime:
    """This rank's seconds in pipeline steps: computing (its layers; sampling on the last stage) and
    waiting (for the previous stage's activations, for the next stage to take its own, for the output)."""

    busy_s: float = 0.0
    wait_s: float = 0.0


STAGE_TIME = StageTime()


@dataclass
class LaunchedStep:
    """A step this stage has done its part of, waiting for the last stage's output."""

    states: list[RunnerRequestState]
    merged: ModelRunnerOutput | None  # the last stage's output (it sampled); None on the other stages
    # (work, tensor) of sends under way: activations to the next stage, or this output to every rank
    sends: list[tuple[Any, torch.Tensor]]


def launch_pipeline_step(
    model: Any,  # a model with forward_stage and norm (LlamaForCausalLM)
    states: list[RunnerRequestState],
    num_scheduled: list[int],
    block_size: int,
    tables: BlockTables,
    pooling: bool,
    outputs: Outputs,
) -> LaunchedStep:
    """This stage's part of the step: its layers on the step's tokens (received from the previous stage,
    sent on to the next; the last stage samples). `tables`: the runner's block tables (every state's
    row). finish_pipeline_step takes the output, once every rank has launched the step: meanwhile this
    stage may launch the next step (of other requests)."""
    stage = get_pp_stage()
    device = tables.device
    dtype = model.embed_tokens.weight.dtype
    hidden_size = model.embed_tokens.weight.shape[1]
    batch = build_step_batch(states, num_scheduled, block_size, device, None, pooling, tables)
    clock = time.perf_counter()
    received = None
    if not stage.is_first:
        n = batch.input_ids.numel()
        received = tuple(recv_from_prev_stage([(n, hidden_size)] * 2, dtype, device))  # (hidden, residual)
        clock = _tick(clock, busy=False)
    hidden, residual = model.forward_stage(batch.input_ids, batch.positions, batch.attn_metadata, received)
    if not stage.is_last:
        sends = send_to_next_stage([hidden, residual])
        _tick(clock, busy=True)
        return LaunchedStep(states, None, sends)
    merged = outputs(model.norm(hidden, residual)[0], batch, states, pooling)
    # Sent at once: the other stages take it when they finish the step, and this stage goes on to the next.
    sends = send_output_from_last_stage(msgspec.msgpack.encode(merged)) if stage.rank == stage.last_stage_rank else []
    _tick(clock, busy=True)
    return LaunchedStep(states, merged, sends)


def finish_pipeline_step(step: LaunchedStep) -> ModelRunnerOutput:
    """The last stage's output of a launched step, on every rank; each rank finishes its launched steps
    in the order it launched them."""
    stage = get_pp_stage()
    clock = time.perf_counter()
    for work, _ in step.sends:  # activations taken by the next stage, or this output by the others
        work.wait()
    if stage.rank == stage.last_stage_rank and step.merged is not None:
        output = step.merged
    else:
        output = msgspec.msgpack.decode(recv_output_of_last_stage(), type=ModelRunnerOutput)
    _tick(clock, busy=False)
    if not stage.is_last:  # the last stage appended its sampled tokens as it sampled them
        for state in step.states:
            state.token_ids.extend(output.sampled_token_ids.get(state.req_id, ()))
    return output


def _tick(since: float, busy: bool) -> float:
    """Add the time since `since` to STAGE_TIME's busy or waiting seconds; returns now."""
    now = time.perf_counter()
    if busy:
        STAGE_TIME.busy_s += now - since
    else:
        STAGE_TIME.wait_s += now - since
    return now
