"""The fleet flags of `tokenmill serve` (--replicas, --autoscale, ...) and the FleetConfig they make.
Both the command (cli.py) and Ray's app builder (app.py) read them, so they sit below both."""

from __future__ import annotations

import argparse

from tokenmill.fleet.config import FleetConfig, parse_autoscale


def add_fleet_flags(serve: argparse.ArgumentParser) -> None:
    """Add the replica flags to `tokenmill serve`'s parser."""
    group = serve.add_argument_group(
        "replicas on Ray Serve (pip install 'tokenmill[ray]'; a local Ray instance, or RAY_ADDRESS's cluster)"
    )
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="serve through N replicas, each its own engine, behind a prefix-aware router",
    )
    group.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="let Ray Serve scale the replicas between MIN and MAX on their ongoing requests",
    )
    group.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=4.0,
        metavar="K",
        help="with --autoscale: queued + running requests per replica the autoscaler aims at (default 4)",
    )
    group.add_argument(
        "--cpus-per-replica",
        type=float,
        default=1.0,
        metavar="C",
        help="CPUs Ray reserves for each replica; its engine uses that many threads (default 1)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="join this Ray cluster (auto: the one this node belongs to, as started by `ray start`; host:port: "
        "its head) instead of starting a local instance (default: $RAY_ADDRESS when set)",
    )
    group.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        metavar="P",
        help="prefill/decode disaggregation: P more replicas (--kv-role prefill) compute long prompts and leave "
        "their KV blocks in the --kv-offloading-path folder, the --replicas ones (--kv-role decode) load them "
        "and generate (default 0: every replica does both)",
    )
    group.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=512,
        metavar="T",
        help="with --prefill-replicas: prompts shorter than about T tokens go straight to a decode replica "
        "(default 512)",
    )
    group.add_argument(
        "--fleet-router",
        choices=("prefix-aware", "ray-default"),
        default="prefix-aware",
        help="prefix-aware: to the replica holding the prompt's prefix when load allows, else the least loaded "
        "in tokens (default); ray-default: Ray Serve's power-of-two-choices on request counts (for comparison)",
    )


def serve_parser() -> argparse.ArgumentParser:
    """`tokenmill serve`'s full parser, fleet flags included (for Ray's app builder)."""
    from tokenmill.server.cli import add_serve_parser

    root = argparse.ArgumentParser(prog="tokenmill")
    serve = add_serve_parser(root.add_subparsers())
    add_fleet_flags(serve)
    return serve


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    """The fleet settings of parsed `tokenmill serve` flags."""
    low, high = parse_autoscale(args.autoscale) if args.autoscale else (None, None)
    return FleetConfig(
        num_replicas=args.replicas or 1,
        min_replicas=low,
        max_replicas=high,
        target_ongoing_requests=args.target_ongoing_requests,
        cpus_per_replica=args.cpus_per_replica,
        prefix_router=args.fleet_router == "prefix-aware",
        prefill_replicas=args.prefill_replicas,
        pd_min_prompt_tokens=args.pd_min_prompt_tokens,
        ray_address=args.ray_address,
    )
