"""Tensor parallelism in local processes: rank 0 runs in this (the engine core's) process, ranks
1..N-1 are spawned followers running the same steps (see spmd.py). Rank 0 sends each command down one pipe per
follower as msgpack bytes: a pipe read blocks without a timeout while the engine idles (a gloo
broadcast would time out), and ends with EOF when rank 0's process dies, so followers never outlive it.

A follower that dies or raises makes rank 0's next collective or send fail; rank 0 then raises an
ExecutorDeadError naming the rank and its exit code, and the engine stops (see EngineCore.step)."""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import check_no_group, destroy_tensor_parallel
from tokenmill.executor.base import ExecutorDeadError
from tokenmill.executor.follower import follower_main
from tokenmill.executor.messages import (
    RANK_REPLIES,
    WORKER_COMMANDS,
    RankFailed,
    RankStarted,
    ReportStageTime,
    Shutdown,
    StageTimeReply,
)
from tokenmill.executor.rank_setup import cores_for_rank, free_port, seed_rank, setup_rank
from tokenmill.executor.spmd import SpmdExecutor
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.pipeline_step import STAGE_TIME

logger = logging.getLogger(__name__)

# How long rank 0 waits for a follower to load its shard (and, at shutdown, to exit).
READY_TIMEOUT_S = 600.0
EXIT_TIMEOUT_S = 10.0
DEATH_GRACE_S = 1.0


class MultiprocExecutor(SpmdExecutor):
    def __init__(
        self, config: EngineConfig, folder: Path | None, eos_token_ids: list[int], grammars: GrammarCompiler
    ) -> None:
        check_no_group()  # before any follower starts: a failed start must not end the other engine's group
        world_size = config.parallel.world_size
        cores = (
            sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        )
        self._saved_cores, self._saved_threads = cores, torch.get_num_threads()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds torch threads
        self.processes: list[BaseProcess] = []
        self.conns: list[Connection] = []
        with _children_allowed():
            for rank in range(1, world_size):
                mine, theirs = ctx.Pipe(duplex=True)
                process = ctx.Process(
                    target=follower_main,
                    args=(
                        config,
                        folder,
                        eos_token_ids,
                        rank,
                        init_method,
                        cores_for_rank(cores, rank, world_size),
                        theirs,
                    ),
                    name=f"tokenmill-tp-rank-{rank}",
                    daemon=True,
                )
                process.start()
                theirs.close()
                self.processes.append(process)
                self.conns.append(mine)
        try:
            self._wait_started()  # before joining the group, which would wait 60 s for a rank that never came
            setup_rank(config, 0, init_method, cores_for_rank(cores, 0, world_size))
            self.driver = ModelRunner(config, folder, eos_token_ids, grammars)
            seed_rank(config)
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (gloo on %s), rank 0 on cores %s", world_size, config.device,
                    cores_for_rank(cores, 0, world_size))  # fmt: skip

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for conn, process in zip(self.conns, self.processes):
            if process.is_alive():
                try:
                    conn.send_bytes(WORKER_COMMANDS.encode(Shutdown()))
                except OSError:
                    pass
        for process in self.processes:
            process.join(EXIT_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(EXIT_TIMEOUT_S)
        for conn in self.conns:
            conn.close()
        destroy_tensor_parallel()
        if hasattr(os, "sched_setaffinity"):  # the engine's process is the caller's: give its cores back
            os.sched_setaffinity(0, self._saved_cores)
        torch.set_num_threads(self._saved_threads)

    def stage_times(self) -> list[tuple[float, float]]:
        """Every rank's (busy, waiting) seconds in pipeline steps so far, rank 0's first (benchmarks)."""
        self._send(ReportStageTime())
        times = [(STAGE_TIME.busy_s, STAGE_TIME.wait_s)]
        for rank, conn in enumerate(self.conns, start=1):
            reply = RANK_REPLIES.decode(conn.recv_bytes())
            if not isinstance(reply, StageTimeReply):
                raise ExecutorDeadError(f"rank {rank} sent {reply!r} for its stage times")
            times.append((reply.busy_s, reply.wait_s))
        return times

    # ------------------------------------------------------------------ SpmdExecutor's hooks
    def _broadcast(self, data: bytes) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                self._wait_for_deaths()
                self._raise_if_dead()
                raise ExecutorDeadError(f"tensor-parallel rank {rank} is unreachable: {exc!r}") from exc

    def _wait_for_deaths(self) -> None:
        for process in self.processes:
            process.join(DEATH_GRACE_S)

    def _raise_if_dead(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                raise ExecutorDeadError(f"tensor-parallel rank {rank} exited with code {process.exitcode}")

    def _wait_started(self) -> None:
        for rank, (conn, process) in enumerate(zip(self.conns, self.processes), start=1):
            if not conn.poll(READY_TIMEOUT_S):
                raise ExecutorDeadError(f"tensor-parallel rank {rank} did not start within {READY_TIMEOUT_S:.0f} s")
            try:
                reply = RANK_REPLIES.decode(conn.recv_bytes())
            except (EOFError, OSError):
                process.join(EXIT_TIMEOUT_S)
                raise RuntimeError(
                    f"tensor-parallel rank {rank}'s process exited (code {process.exitcode}) before it started. "
                    "Ranks start with 'spawn' and import the main module again, so a script must create "
                    'LLM(tensor_parallel_size > 1) under `if __name__ == "__main__":` (see its log above).'
                ) from None
            if not isinstance(reply, RankStarted):
                raise ExecutorDeadError(f"tensor-parallel rank {rank} sent {reply!r} before it started")

    def _wait_ready(self) -> None:
        for rank, (conn, process) in enumerate(zip(self.conns, self.processes), start=1):
            if not conn.poll(READY_TIMEOUT_S):
                raise ExecutorDeadError(f"tensor-parallel rank {rank} did not load within {READY_TIMEOUT_S:.0f} s")
            try:
                reply = RANK_REPLIES.decode(conn.recv_bytes())
            except (EOFError, OSError) as exc:
                raise ExecutorDeadError(
                    f"tensor-parallel rank {rank} died while loading (exit code {process.exitcode})"
                ) from exc
            if isinstance(reply, RankFailed):
                raise ExecutorDeadError(f"tensor-parallel rank {rank} failed to load: {reply.reason}")


@contextmanager
def _children_allowed() -> Iterator[None]:
    """The engine process is daemonic (it must die with the server), and multiprocessing refuses children
    of a daemonic process so they cannot be orphaned; our followers exit by themselves when rank 0's pipe
    closes, so lift the flag while they start."""
    current = multiprocessing.current_process()
    daemon = current._config.get("daemon", False)  # type: ignore[attr-defined]
    current._config["daemon"] = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        current._config["daemon"] = daemon  # type: ignore[attr-defined]
