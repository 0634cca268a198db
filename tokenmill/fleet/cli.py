"""`tokenmill serve --replicas N` / `--autoscale MIN:MAX`: the fleet flags on the serve command. Without
them `tokenmill serve` runs one server as before, and Ray is never imported."""

from __future__ import annotations

import argparse
import logging


def add_fleet_args(serve: argparse.ArgumentParser) -> None:
    """Add the replica flags to `tokenmill serve`'s parser and route it through `cmd_serve`."""
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
        "--fleet-router",
        choices=("prefix-aware", "ray-default"),
        default="prefix-aware",
        help="prefix-aware: to the replica holding the prompt's prefix when load allows, else the least loaded "
        "in tokens (default); ray-default: Ray Serve's power-of-two-choices on request counts (for comparison)",
    )
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    from tokenmill.server import cli as server_cli

    if args.replicas is None and args.autoscale is None:
        server_cli.cmd_serve(args)
        return
    from tokenmill.fleet.app import fleet_config
    from tokenmill.fleet.launcher import serve_fleet

    logging.getLogger("tokenmill").setLevel(args.log_level.upper())
    try:
        fleet = fleet_config(args)
    except ValueError as exc:
        raise SystemExit(f"tokenmill serve: error: {exc}") from None
    serve_fleet(*server_cli.engine_and_server_config(args), fleet)


def serve_parser() -> argparse.ArgumentParser:
    """`tokenmill serve`'s full parser, fleet flags included (for `build_app`)."""
    from tokenmill.server.cli import add_serve_parser

    root = argparse.ArgumentParser(prog="tokenmill")
    serve = add_serve_parser(root.add_subparsers())
    add_fleet_args(serve)
    return serve
