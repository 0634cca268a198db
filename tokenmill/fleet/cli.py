"""`tokenmill serve --replicas N` / `--autoscale MIN:MAX`: the fleet flags on the serve command. Without
them `tokenmill serve` runs one server as before, and Ray is never imported."""

from __future__ import annotations

import argparse
import logging

from tokenmill.fleet.flags import add_fleet_flags, fleet_config


def add_fleet_args(serve: argparse.ArgumentParser) -> None:
    """Add the replica flags to `tokenmill serve`'s parser and route it through `cmd_serve`."""
    add_fleet_flags(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    from tokenmill.server import cli as server_cli

    if args.replicas is None and args.autoscale is None and not args.prefill_replicas:
        server_cli.cmd_serve(args)
        return
    from tokenmill.fleet.launcher import serve_fleet

    logging.getLogger("tokenmill").setLevel(args.log_level.upper())
    try:
        fleet = fleet_config(args)
    except ValueError as exc:
        raise SystemExit(f"tokenmill serve: error: {exc}") from None
    serve_fleet(*server_cli.engine_and_server_config(args), fleet)
