"""The commands rank 0 sends its followers, and a follower's replies (started; loaded, or not), one msgspec
Struct each, as msgpack by field name (tokenmill.wire; never pickle). The step command carries the
whole SchedulerOutput, so every rank updates the same request states and runs the same step."""

from __future__ import annotations

from tokenmill.outputs import SchedulerOutput
from tokenmill.wire import Codec, Message


class ExecuteStep(Message):
    sched: SchedulerOutput  # num_scheduled_tokens keeps its order on the wire: the batch's row order


class LaunchStep(Message):
    """Pipeline stages: this rank's part of a step, its output taken by a later CollectStep."""

    sched: SchedulerOutput


class CollectStep(Message):
    """Pipeline stages: take the oldest launched step's output (every rank joins its broadcast)."""


class AllocateKVCache(Message):
    num_blocks: int


class ProfileRun(Message):
    pass


class CaptureCudaGraphs(Message):
    pass


class Shutdown(Message):
    pass


class ReportStageTime(Message):
    """Reply with this rank's StageTime (pipeline stages: seconds busy and waiting in steps)."""


WorkerCommand = (
    ExecuteStep
    | LaunchStep
    | CollectStep
    | AllocateKVCache
    | ProfileRun
    | CaptureCudaGraphs
    | Shutdown
    | ReportStageTime
)

WORKER_COMMANDS: Codec[WorkerCommand] = Codec(WorkerCommand, "command from rank 0")


class RankStarted(Message):
    """The follower's process has started: it got past re-importing the main module ("spawn")."""


class RankReady(Message):
    """The follower has loaded its shard and waits for commands."""


class RankFailed(Message):
    """Loading the follower's shard failed; it exits."""

    reason: str


class StageTimeReply(Message):
    busy_s: float
    wait_s: float


RankReply = RankStarted | RankReady | RankFailed | StageTimeReply

RANK_REPLIES: Codec[RankReply] = Codec(RankReply, "reply from a tensor-parallel rank")
