"""`--log-format json` reaches every process: the server sets the format for the processes it spawns, and the
engine process's own lines (here: a model load that fails) come out as JSON objects tagged with its role;
`serve` logs its start-up phases, one record (one JSON object) each."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import engine_args, free_port
from tokenmill.log_format import LOG_FORMAT_ENV, JsonFormatter
from tokenmill.metrics.logs import use_json_logs
from tokenmill.server.config import ServerConfig
from tokenmill.server.launcher import GracefulServer, serve

# The engine process's entry point, given no config: loading fails at once and is logged.
ENGINE_PROCESS_FAILS = """
from multiprocessing import Pipe
from tokenmill.engine.core_client import run_engine_process
from tokenmill.engine.messages import EVENTS
commands, _ = Pipe(duplex=False)
events, events_out = Pipe(duplex=False)
run_engine_process(None, None, commands, events_out, 0.0)
print(type(EVENTS.decode(events.recv_bytes())).__name__)
"""


def run_engine_process_failing(log_format: str) -> list[str]:
    env = os.environ | {LOG_FORMAT_ENV: log_format}
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_PROCESS_FAILS], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "EngineStartFailed"  # the server still hears why
    return [line for line in done.stderr.splitlines() if line.strip()]


def test_the_engine_process_logs_json_objects_when_the_server_does() -> None:
    lines = run_engine_process_failing("json")
    entries = [json.loads(line) for line in lines]  # every line is one object
    failure = [e for e in entries if e["message"] == "loading the model failed"]
    assert len(failure) == 1
    assert failure[0]["level"] == "error" and failure[0]["process"] == "engine"
    assert failure[0]["logger"] == "tokenmill.engine.core_client"
    assert "AttributeError" in failure[0]["exception"]


def test_use_json_logs_passes_the_format_to_processes_spawned_later(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setenv(LOG_FORMAT_ENV, "text")  # restored (unset) when the test ends
    use_json_logs("warning")
    assert os.environ[LOG_FORMAT_ENV] == "json"
    assert root.handlers[0].formatter is not None
    record = logging.LogRecord("tokenmill.server", logging.WARNING, __file__, 1, "up", (), None)
    assert json.loads(root.handlers[0].formatter.format(record))["process"] == "server"


def test_serve_logs_its_start_up_phases_as_text_and_json(
    chat_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`serve` up to the moment uvicorn has started (the engine on a thread: no process to spawn)."""
    monkeypatch.setattr(GracefulServer, "run", lambda self: [callback(self) for callback in self.on_started])
    caplog.set_level(logging.INFO, logger="tokenmill.startup")
    args = engine_args(chat_model)
    serve(args, ServerConfig(engine_in_thread=True, port=free_port()))
    phases = [json.loads(JsonFormatter("server").format(r))["phase"] for r in caplog.records]
    assert phases == [
        "config",
        "engine load",
        "tokenizer",
        "app",
        "waiting for the engine",
        "engine model",
        "engine KV cache",
        "engine warm-up",
        "ready",
    ]
    assert caplog.records[-1].getMessage().startswith("start-up: ready in ")
    assert caplog.records[1].getMessage().startswith("start-up: engine load ")
