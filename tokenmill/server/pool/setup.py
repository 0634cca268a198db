"""Build the server's state with its model pool: the access config's keys join the API keys, and the
pool gets the catalog (registry, extra models) and a way to start engines like the default one."""

from __future__ import annotations

import dataclasses

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.restart_policy import RestartPolicy
from tokenmill.registry import Registry
from tokenmill.server.config import ServerConfig, ServerState
from tokenmill.server.pool.access import AccessPolicy, KeyAccess
from tokenmill.server.pool.catalog import REGISTRY_LOCK_TIMEOUT_S, Catalog
from tokenmill.server.pool.pool import ModelPool, NewEngine


def engine_factory(config: ServerConfig) -> NewEngine:
    """Engines for pooled models, started as the default model's is: in a process of their own unless
    --engine-in-thread, restarted by the same policy."""

    def new_engine(args: EngineArgs) -> AsyncEngine:
        return AsyncEngine(
            args,
            config.engine_stall_timeout_s,
            engine_process=not config.engine_in_thread,
            restart_policy=RestartPolicy(max_restarts=config.max_engine_restarts),
            step_timeout_s=config.engine_step_timeout_s,
        )

    return new_engine


def create_state(
    config: ServerConfig, engine: AsyncEngine, engine_args: EngineArgs, new_engine: NewEngine | None = None
) -> ServerState:
    """ServerState.create, plus the model pool when the config serves several models."""
    pool_config = config.models
    access_path = pool_config.access_path()
    policy = AccessPolicy.load(access_path) if access_path is not None else None
    if policy is not None:
        config = dataclasses.replace(config, api_keys=config.api_keys + policy.keys)
    state = ServerState.create(config, engine)
    if not pool_config.enabled:
        return state
    registry = None
    if pool_config.registry is not None:
        registry = Registry(pool_config.registry, lock_timeout_s=REGISTRY_LOCK_TIMEOUT_S)
    access = None
    if policy is not None:
        by_name = {state.keys.identify(f"Bearer {key}"): patterns for key, patterns in policy.patterns.items()}
        access = KeyAccess(policy, by_name)
    catalog = Catalog(registry, pool_config.extra_models)
    state.models = ModelPool(state, engine_args, catalog, pool_config, access, new_engine or engine_factory(config))
    return state
