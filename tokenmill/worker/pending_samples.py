"""A launched step's samples on their way to the host.

The runner launches a step (forward, sampling) and hands its sampled ids to the host later, when the
engine collects it: on CUDA they start a non-blocking copy into pinned memory at launch, with an event
the collect waits on; the device meanwhile runs the next step, whose inputs read those ids on the device.
Until then each sampling request holds a PLACEHOLDER as its last token (lengths, positions and seeds
stay right; only the value is unknown on the host)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.worker.input_batch import RunnerRequestState

# A sampled token whose value is still on the device.
PLACEHOLDER = -1


class HostCopy:
    """Tensors copied to the host without blocking it: pinned buffers, non-blocking copies and an event
    on CUDA; on the CPU the tensors themselves (already computed)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.event: torch.cuda.Event | None = None
        if tensors and tensors[0].is_cuda:
            self.tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, device in zip(self.tensors, tensors):
                host.copy_(device, non_blocking=True)
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.event.record()
        else:
            self.tensors = list(tensors)

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


@dataclass
class PendingSamples:
    """One step's sampled rows, in order: each row's request state and the index in its token_ids of
    the placeholder that the row's token replaces. `copy` holds the sampled ids [num_rows] int64, then
    (when some row asked for logprobs) the sampler's top-k ids, logprobs and ranks of every row.
    `constrained`: grammars take the tokens too."""

    states: list[RunnerRequestState]
    positions: list[int]
    copy: HostCopy
    constrained: bool
    rows: dict[str, int]  # each request's row

    @property
    def req_ids(self) -> list[str]:
        return [s.req_id for s in self.states]


def hold_places(states: list[RunnerRequestState]) -> list[int]:
    """Append a placeholder to each state's tokens; their indices."""
    positions = []
    for state in states:
        state.token_ids.append(PLACEHOLDER)
        positions.append(len(state.token_ids) - 1)
    return positions


def fill_places(pending: PendingSamples, tokens: list[int]) -> None:
    """The host learns the step's tokens: each replaces its request's placeholder."""
    for state, position, token in zip(pending.states, pending.positions, tokens):
        state.token_ids[position] = token
