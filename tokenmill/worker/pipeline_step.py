"""One step on a pipeline stage: its decoder layers on micro-batches of the step's requests, activations
received from the previous stage and sent to the next; the last stage samples, and every rank takes its
output (so every rank's request states stay in lockstep, as under tensor parallelism).

The step's requests are split into up to one micro-batch per stage, of about equal tokens: while stage
s runs micro-batch m, stage s - 1 runs m + 1, so a step of M micro-batches over P stages takes about
(M + P - 1) / M stage-times where one batch would take P. (Micro-batches of successive steps do not
overlap: the engine schedules one step at a time.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from tokenmill.distributed.communication import broadcast_from_last_stage, recv_from_prev_stage, send_to_next_stage
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


def micro_batches(num_scheduled: list[int], num_stages: int) -> list[range]:
    """Consecutive requests split into at most `num_stages` groups of about equal tokens (none empty)."""
    total = sum(num_scheduled)
    groups: list[range] = []
    start, tokens = 0, 0
    for i, n in enumerate(num_scheduled):
        tokens += n
        left_groups = num_stages - len(groups) - 1
        if left_groups and tokens * num_stages >= total * (len(groups) + 1) and len(num_scheduled) - i - 1 > 0:
            groups.append(range(start, i + 1))
            start = i + 1
    groups.append(range(start, len(num_scheduled)))
    return groups


def run_pipeline_step(
    model: Any,  # a model with forward_stage and norm (LlamaForCausalLM)
    states: list[RunnerRequestState],
    num_scheduled: list[int],
    block_size: int,
    tables: BlockTables,
    pooling: bool,
    outputs: Outputs,
) -> ModelRunnerOutput:
    """This stage's part of the step; the last stage's output, on every rank. `tables`: the runner's
    block tables (every state's row)."""
    stage = get_pp_stage()
    device = tables.device
    dtype = model.embed_tokens.weight.dtype
    hidden_size = model.embed_tokens.weight.shape[1]
    merged = ModelRunnerOutput(sampled_token_ids={})
    batches = []
    for group in micro_batches(num_scheduled, stage.num_stages):
        part = [states[i] for i in group]
        batch = build_step_batch(part, [num_scheduled[i] for i in group], block_size, device, None, pooling, tables)
        batches.append((batch, part))
    clock = time.perf_counter()
    for batch, part in batches:
        received = None
        if not stage.is_first:
            n = batch.input_ids.numel()
            hidden_in, residual_in = recv_from_prev_stage([(n, hidden_size)] * 2, dtype, device)
            received = (hidden_in, residual_in)
            clock = _tick(clock, busy=False)
        hidden, residual = model.forward_stage(batch.input_ids, batch.positions, batch.attn_metadata, received)
        if not stage.is_last:
            clock = _tick(clock, busy=True)
            send_to_next_stage([hidden, residual])
            clock = _tick(clock, busy=False)
            continue
        _merge(merged, outputs(model.norm(hidden, residual)[0], batch, part, pooling))
        clock = _tick(clock, busy=True)
    data = msgspec.msgpack.encode(merged) if stage.is_last else None
    output = msgspec.msgpack.decode(broadcast_from_last_stage(data), type=ModelRunnerOutput)
    _tick(clock, busy=False)
    if not stage.is_last:  # the last stage appended its sampled tokens as it sampled them
        for state in states:
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


def _merge(into: ModelRunnerOutput, part: ModelRunnerOutput) -> None:
    into.sampled_token_ids.update(part.sampled_token_ids)
    into.logprobs.update(part.logprobs)
    into.prompt_logprobs.update(part.prompt_logprobs)
    into.pooled.update(part.pooled)
