"""Run the fleet: connect to Ray (RAY_ADDRESS's cluster, else a local instance started here), start
Ray Serve's HTTP proxy on --host/--port, deploy the application, and serve until SIGINT/SIGTERM.
On the signal, Ray Serve stops the replicas (each drains its in-flight requests for up to
--shutdown-timeout), then the local Ray instance stops."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

from tokenmill.config import EngineArgs
from tokenmill.fleet.app import APP_NAME, fleet_application
from tokenmill.fleet.config import FleetConfig
from tokenmill.server.config import ServerConfig

logger = logging.getLogger(__name__)


class FleetRun:
    """A started fleet; `stop()` undeploys it and leaves Ray (stopping a local instance it started)."""

    def __init__(
        self, engine_args: EngineArgs, config: ServerConfig, fleet: FleetConfig, log_to_driver: bool = True
    ) -> None:
        if config.tls:
            raise ValueError("--replicas does not serve https yet: put a TLS proxy in front, or drop --ssl-*")
        import ray
        from ray import serve

        address = fleet.ray_address or os.environ.get("RAY_ADDRESS")
        if not ray.is_initialized():
            # A local instance without the dashboard: it would take memory and CPU from the replicas.
            ray.init(address=address, include_dashboard=False if address is None else None, log_to_driver=log_to_driver)
        serve.start(http_options={"host": config.host, "port": config.port})
        low, high = fleet.bounds
        logger.info(
            "deploying %s replicas (%d CPU each) on Ray Serve",
            f"{low}..{high}" if low != high else low,
            fleet.cpus_per_replica,
        )
        serve.run(fleet_application(engine_args, config, fleet), name=APP_NAME, route_prefix="/")
        self.url = f"http://{'127.0.0.1' if config.host in ('0.0.0.0', '::') else config.host}:{config.port}"

    def stop(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def serve_fleet(engine_args: EngineArgs, config: ServerConfig, fleet: FleetConfig) -> None:
    """Serve until SIGINT or SIGTERM, then shut the fleet down; a second signal exits at once."""
    try:
        run = FleetRun(engine_args, config, fleet)
    except ValueError as exc:
        raise SystemExit(f"tokenmill serve: error: {exc}") from None
    print(f"\ntokenmill is serving through Ray Serve at {run.url}/v1 (Ctrl-C to stop)\n", flush=True)
    stop = threading.Event()

    def on_signal(sig: int, _: FrameType | None) -> None:
        if stop.is_set():
            os._exit(128 + sig)
        logger.warning("stopping the fleet: replicas finish their requests for up to %.0f s", config.shutdown_timeout_s)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stop.wait()
    run.stop()
