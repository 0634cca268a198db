"""The Ray Serve application: an ingress deployment in front of a replica deployment whose router is
LLMRequestRouter (and, with --prefill-replicas, a prefill deployment beside it: disaggregation.py).
Start it with `tokenmill serve --replicas N` (launcher.py) or with Ray's CLI:

    serve run tokenmill.fleet.app:build_app args="--replicas 2 --max-model-len 1024 MODEL"

where `args` holds `tokenmill serve` flags."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.config import EngineArgs
from tokenmill.fleet.config import FleetConfig
from tokenmill.server.config import ServerConfig

if TYPE_CHECKING:
    from ray.serve import Application

APP_NAME = "tokenmill"
REPLICA_DEPLOYMENT = "TokenmillReplica"
INGRESS_DEPLOYMENT = "TokenmillIngress"
PREFILL_DEPLOYMENT = "TokenmillPrefill"


def fleet_application(engine_args: EngineArgs, config: ServerConfig, fleet: FleetConfig) -> Application:
    """The application for these settings (bind only: nothing starts until it is run)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from tokenmill.fleet.autoscaling import TokenLoadPolicy
    from tokenmill.fleet.ingress import FleetIngress
    from tokenmill.fleet.replica import ReplicaServer
    from tokenmill.fleet.router import LLMRequestRouter, StatsPowerOfTwoRouter

    model = config.served_model_name or (Path(engine_args.model).name if engine_args.model else "default")
    low, high = fleet.bounds
    scaling: dict[str, Any] = (
        {
            "autoscaling_config": {
                "min_replicas": low,
                "max_replicas": high,
                "target_ongoing_requests": fleet.target_ongoing_requests,
                "upscale_delay_s": fleet.upscale_delay_s,
                "downscale_delay_s": fleet.downscale_delay_s,
                "look_back_period_s": 5.0,
                "policy": {
                    "policy_function": TokenLoadPolicy,
                    "policy_kwargs": {"target_load_tokens": fleet.target_load_tokens},
                },
            }
        }
        if fleet.autoscale
        else {"num_replicas": fleet.num_replicas}
    )
    deployment: Any = serve.deployment  # its overloads do not type the options form

    def replicas(name: str, role: str, **options: Any) -> Any:
        router: dict[str, Any] = {
            "request_router_class": LLMRequestRouter if fleet.prefix_router else StatsPowerOfTwoRouter,
            "request_router_kwargs": {"slack_tokens": fleet.slack_tokens, "model_name": model, "role": role},
            "request_routing_stats_period_s": fleet.routing_stats_period_s,
        }
        return deployment(
            ReplicaServer,
            name=name,
            ray_actor_options={"num_cpus": fleet.cpus_per_replica},
            max_ongoing_requests=fleet.max_ongoing_requests,
            health_check_period_s=fleet.health_check_period_s,
            health_check_timeout_s=fleet.health_check_timeout_s,
            graceful_shutdown_timeout_s=config.shutdown_timeout_s + 5,
            request_router_config=RequestRouterConfig(**router),
            **options,
        )

    prefill = None
    if fleet.disaggregated:
        check_disaggregation(engine_args)
        prefill = replicas(PREFILL_DEPLOYMENT, "prefill", num_replicas=fleet.prefill_replicas).bind(
            replace(engine_args, kv_role="prefill"), config, fleet.num_threads
        )
        engine_args = replace(engine_args, kv_role="decode")
    replica = replicas(REPLICA_DEPLOYMENT, "decode" if fleet.disaggregated else "both", **scaling)
    # The ingress does no model work: it takes no CPU from the replicas' share.
    ingress = deployment(
        FleetIngress,
        name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=high * fleet.max_ongoing_requests * 2,
    )
    app: Application = ingress.bind(
        replica.bind(engine_args, config, fleet.num_threads), config, fleet, model, prefill=prefill
    )
    return app


def check_disaggregation(engine_args: EngineArgs) -> None:
    """--prefill-replicas sets each replica's kv_role and passes blocks through the file tier's folder."""
    if engine_args.kv_role != "both":
        raise ValueError("--prefill-replicas sets each replica's --kv-role itself: drop --kv-role")
    if engine_args.kv_offloading_size is None:
        raise ValueError(
            "--prefill-replicas passes KV blocks through the second KV tier's folder: give --kv-offloading-size "
            "(and --kv-offloading-path: a folder every node shares, when replicas run on several nodes)"
        )
    if engine_args.device != "cpu":
        raise ValueError("--prefill-replicas runs on CPUs: on CUDA the second KV tier is each engine's host memory")


def build_app(args: dict[str, str]) -> Application:
    """Ray Serve's app builder (`serve run tokenmill.fleet.app:build_app args="..."`): `args` holds
    `tokenmill serve` flags, e.g. "--replicas 2 --max-model-len 1024 MODEL"."""
    unknown = set(args) - {"args"}
    if unknown:
        raise ValueError(f'build_app takes one argument, args="<tokenmill serve flags>" (got {sorted(unknown)})')
    from tokenmill.fleet.flags import fleet_config, serve_parser
    from tokenmill.server.cli import engine_and_server_config
    from tokenmill.settings import parse_args

    parsed = parse_args(serve_parser(), shlex.split(args.get("args", "")))
    engine_args, config = engine_and_server_config(parsed)
    return fleet_application(engine_args, config, fleet_config(parsed))
