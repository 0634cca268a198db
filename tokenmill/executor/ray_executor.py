"""Tensor parallelism on Ray (`--distributed-executor-backend ray`): ranks 1..N-1 are Ray actors placed by
a placement group (one bundle of cores per rank, packed onto as few nodes as fit), so the ranks may span
machines; rank 0 stays in the engine's process, the Ray driver, and runs the same steps (see spmd.py).
gloo joins the ranks through rank 0's address. Ray is imported here only: the core install never needs it.

Commands go to the actors as ordinary actor calls carrying the msgpack bytes; an actor runs its calls in
the order they were sent. Each call's result is kept until the next, so a rank that raised or died is
seen (with its error) at the next command, or at once when rank 0's collective breaks. The model folder
must exist at the same path on every node."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed.parallel_state import check_no_group, destroy_tensor_parallel
from tokenmill.executor.base import ExecutorDeadError
from tokenmill.executor.follower import follower_grammars, run_command
from tokenmill.executor.messages import WORKER_COMMANDS, Shutdown
from tokenmill.executor.rank_setup import cores_for_rank, free_port, pin_to_cores, seed_rank, setup_rank
from tokenmill.executor.spmd import SpmdExecutor
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 600.0
DEATH_GRACE_S = 1.0


class RankActor:
    """One follower rank as a Ray actor (the class is wrapped with ray.remote when the executor starts)."""

    def __init__(
        self,
        config: EngineConfig,
        folder: Path | None,
        eos_token_ids: list[int],
        rank: int,
        init_method: str,
        driver_ip: str,
        num_cpus: int,
    ) -> None:
        import ray

        world_size = config.parallel.world_size
        if ray.util.get_node_ip_address() == driver_ip:  # type: ignore[no-untyped-call]  # beside rank 0: split this machine's cores with it
            cores = cores_for_rank(sorted(os.sched_getaffinity(0)), rank, world_size)
        else:
            cores = sorted(os.sched_getaffinity(0))[:num_cpus]
        setup_rank(config, rank, init_method, cores)
        self.runner = ModelRunner(config, folder, eos_token_ids, follower_grammars(config, eos_token_ids))
        seed_rank(config)

    def ready(self) -> bool:
        return True

    def node_id(self) -> str:
        """The Ray node this rank runs on (ranks of a placement group may span nodes)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def run(self, data: bytes) -> None:
        run_command(self.runner, WORKER_COMMANDS.decode(data))


class RayExecutor(SpmdExecutor):
    def __init__(
        self, config: EngineConfig, folder: Path | None, eos_token_ids: list[int], grammars: GrammarCompiler
    ) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise ValueError(
                "distributed_executor_backend 'ray' needs Ray: pip install 'tokenmill[ray]' (or use 'mp')."
            ) from exc
        self._ray: Any = ray
        check_no_group()  # before any follower starts: a failed start must not end the other engine's group
        world_size = config.parallel.world_size
        cores = sorted(os.sched_getaffinity(0))
        self._saved_cores, self._saved_threads = cores, torch.get_num_threads()
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(log_to_driver=False)  # RAY_ADDRESS, when set, names the cluster to join
        num_cpus = max(1, len(cores) // world_size)
        self._group = placement_group([{"CPU": num_cpus}] * world_size, strategy="PACK")
        self.actors: list[Any] = []
        self._last_calls: list[Any] = []
        try:
            if not ray.get(self._group.ready(), timeout=PLACEMENT_TIMEOUT_S):
                raise ValueError(f"Ray could not place {world_size} ranks of {num_cpus} CPUs each")
            driver_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            init_method = f"tcp://{driver_ip}:{free_port()}"
            actor_class = ray.remote(RankActor)
            for rank in range(1, world_size):
                strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=rank)
                options = actor_class.options(num_cpus=num_cpus, scheduling_strategy=strategy)
                self.actors.append(
                    options.remote(config, folder, eos_token_ids, rank, init_method, driver_ip, num_cpus)
                )
            setup_rank(config, 0, init_method, cores_for_rank(cores, 0, world_size))
            self.driver = ModelRunner(config, folder, eos_token_ids, grammars)
            seed_rank(config)
            self._last_calls = [actor.ready.remote() for actor in self.actors]
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks as Ray actors, %d CPUs each", world_size, num_cpus)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        ray = self._ray
        for actor in self.actors:
            try:
                actor.run.remote(WORKER_COMMANDS.encode(Shutdown()))
                ray.kill(actor)
            except Exception:  # already gone
                pass
        ray.util.remove_placement_group(self._group)
        destroy_tensor_parallel()
        if self._started_ray:
            ray.shutdown()
        pin_to_cores(self._saved_cores)
        torch.set_num_threads(self._saved_threads)

    # ------------------------------------------------------------------ SpmdExecutor's hooks
    def _broadcast(self, data: bytes) -> None:
        self._last_calls = [actor.run.remote(data) for actor in self.actors]

    def _wait_for_deaths(self) -> None:
        self._ray.wait(self._last_calls, num_returns=len(self._last_calls), timeout=DEATH_GRACE_S)

    def _raise_if_dead(self) -> None:
        ray = self._ray
        for rank, call in enumerate(self._last_calls, start=1):
            done, _ = ray.wait([call], timeout=0)
            if done:
                try:
                    ray.get(call)
                except Exception as exc:
                    raise ExecutorDeadError(f"tensor-parallel rank {rank} (a Ray actor) failed: {exc}") from exc

    def _wait_ready(self) -> None:
        ray = self._ray
        for rank, call in enumerate(self._last_calls, start=1):
            try:
                ray.get(call, timeout=READY_TIMEOUT_S)
            except Exception as exc:
                raise ExecutorDeadError(f"tensor-parallel rank {rank} (a Ray actor) failed to load: {exc}") from exc
