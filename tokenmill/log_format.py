"""`--log-format json` in every tokenmill process: the server, its engine process and tensor-parallel ranks.

The server selects it with `use_json_logs` (tokenmill/metrics/logs.py), which also sets LOG_FORMAT_ENV in
its environment; the processes it spawns later inherit that and call `configure_child_logging` first
thing, so their own lines (a failed model load, a failed step) reach the log aggregator as JSON too. A leaf
module (standard library only), so the engine and executor layers can use it.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone

LOG_FORMAT_ENV = "TOKENMILL_LOG_FORMAT"  # "json" or "text"; set by the serving process for its children


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the process role when given, a start-up
    phase's name and seconds, and the exception's traceback when there is one (its newlines escaped: one
    line per record)."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.process is not None:
            entry["process"] = self.process
        phase = getattr(record, "phase", None)
        if phase is not None:  # a start-up phase (startup_phases.py): its name and seconds as fields
            entry["phase"] = phase
            entry["seconds"] = record.__dict__["seconds"]
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_child_logging(process: str, text_format: str, level: int = logging.WARNING) -> None:
    """A spawned process's logging: JSON lines tagged with `process` when its parent logs JSON, else
    `text_format`."""
    if os.environ.get(LOG_FORMAT_ENV) == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter(process))
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(level)
    else:
        logging.basicConfig(level=level, format=text_format)
