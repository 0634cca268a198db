"""`--log-format json`: one JSON object per log line (time, level, logger, message, process, and the
exception when there is one), for log aggregators; the formatter lives in tokenmill/log_format.py, where
the engine process and tensor-parallel ranks pick the same format up."""

from __future__ import annotations

import logging
import os

from tokenmill.log_format import LOG_FORMAT_ENV, JsonFormatter

__all__ = ["JsonFormatter", "use_json_logs"]

_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")


def use_json_logs(level: str = "info") -> None:
    """Route every logger of this process (uvicorn's too, once it is started with log_config=None) through
    one JSON handler, and have the processes it spawns from now on log JSON as well."""
    os.environ[LOG_FORMAT_ENV] = "json"
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter("server"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _UVICORN:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
