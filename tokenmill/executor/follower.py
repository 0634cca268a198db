"""A follower rank (1..N-1): load this rank's shard, then run every command rank 0 sends, in order.

It never samples for anyone: its runner runs the same steps as rank 0's on the same inputs (its
sampled tokens, identical to rank 0's, keep its request states in lockstep) and its outputs are
dropped. It exits when rank 0's pipe closes, so it never outlives the engine."""

from __future__ import annotations

import logging
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import destroy_tensor_parallel
from tokenmill.executor.messages import (
    RANK_REPLIES,
    WORKER_COMMANDS,
    AllocateKVCache,
    CaptureCudaGraphs,
    CollectStep,
    ExecuteStep,
    LaunchStep,
    ProfileRun,
    RankFailed,
    RankReady,
    RankStarted,
    ReportStageTime,
    Shutdown,
    StageTimeReply,
    WorkerCommand,
)
from tokenmill.executor.rank_setup import seed_rank, setup_rank
from tokenmill.loader.hf import load_tokenizer
from tokenmill.log_format import configure_child_logging
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.llguidance_backend import LLGuidanceBackend
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.pipeline_step import STAGE_TIME

logger = logging.getLogger(__name__)


def follower_main(
    config: EngineConfig,
    folder: Path | None,
    eos_token_ids: list[int],
    rank: int,
    init_method: str,
    cores: list[int],
    conn: Connection,
) -> None:
    """The process target of rank `rank`: reports it has started on `conn`, then ready or failed after loading."""
    conn.send_bytes(RANK_REPLIES.encode(RankStarted()))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine, which stops us in order
    configure_child_logging(f"rank {rank}", f"tokenmill rank {rank}: %(levelname)s %(message)s")
    try:
        setup_rank(config, rank, init_method, cores)
        runner = ModelRunner(config, folder, eos_token_ids, follower_grammars(config, eos_token_ids))
        seed_rank(config)
    except Exception as exc:
        logger.exception("loading rank %d failed", rank)
        conn.send_bytes(RANK_REPLIES.encode(RankFailed(f"{type(exc).__name__}: {exc}")))
        sys.exit(1)
    conn.send_bytes(RANK_REPLIES.encode(RankReady()))
    try:
        _serve(runner, conn)
    finally:
        destroy_tensor_parallel()


def _serve(runner: ModelRunner, conn: Connection) -> None:
    while True:
        try:
            command = WORKER_COMMANDS.decode(conn.recv_bytes())
        except (EOFError, OSError):  # rank 0 is gone
            return
        if isinstance(command, ReportStageTime):
            conn.send_bytes(RANK_REPLIES.encode(StageTimeReply(STAGE_TIME.busy_s, STAGE_TIME.wait_s)))
        elif not run_command(runner, command):
            return


def run_command(runner: ModelRunner, command: WorkerCommand) -> bool:
    """Run one of rank 0's commands on this rank's runner; False once told to shut down. An exception
    ends the follower: rank 0 then sees the rank gone."""
    if isinstance(command, ExecuteStep):
        runner.execute(command.sched)
    elif isinstance(command, LaunchStep):
        runner.launch(command.sched)
    elif isinstance(command, CollectStep):
        runner.collect()
    elif isinstance(command, AllocateKVCache):
        runner.allocate_kv_cache(command.num_blocks)
    elif isinstance(command, ProfileRun):
        runner.profile_run()
    elif isinstance(command, CaptureCudaGraphs):
        runner.capture_cuda_graphs()
    elif isinstance(command, Shutdown):
        return False
    return True


def follower_grammars(config: EngineConfig, eos_token_ids: list[int]) -> GrammarCompiler:
    """This rank's own grammar compiler (as the engine core's: the tokenizer loads on first use)."""
    tokenizer = config.model.tokenizer
    if tokenizer is None:
        return GrammarCompiler(None)
    vocab_size = config.model.vocab_size
    return GrammarCompiler(lambda: LLGuidanceBackend(load_tokenizer(tokenizer), vocab_size, eos_token_ids))
