"""Logging inside Ray Serve processes: Ray Serve sets up handlers for its own logger only, so
tokenmill's INFO lines (scaling events, replica starts) would be dropped. Send them through it."""

from __future__ import annotations

import logging


def use_serve_logging(level: int = logging.INFO) -> None:
    """Write the `tokenmill` loggers through Ray Serve's handlers (its replica log files and, with
    log_to_driver, the console of the process that started the fleet)."""
    ours, serve = logging.getLogger("tokenmill"), logging.getLogger("ray.serve")
    ours.setLevel(level)
    for handler in serve.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = not serve.handlers
