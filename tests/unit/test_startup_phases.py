"""Start-up phases (tokenmill/startup_phases.py): one log record per phase, with its name and seconds as
fields of the JSON object `--log-format json` writes, and a summary once ready; silent when only recording."""

from __future__ import annotations

import json
import logging
import time

import pytest

from tokenmill.log_format import JsonFormatter
from tokenmill.startup_phases import StartupPhases


def test_each_phase_is_one_record_then_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.startup")
    phases = StartupPhases()
    with phases.phase("tokenizer"):
        time.sleep(0.02)
    phases.record("engine model", 0.4)
    total = phases.ready()
    assert [name for name, _ in phases.phases] == ["tokenizer", "engine model"]
    assert phases.phases[0][1] >= 0.02 and total >= 0.02
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:2] == [f"start-up: tokenizer {phases.phases[0][1]:.2f} s", "start-up: engine model 0.40 s"]
    assert messages[2].startswith("start-up: ready in ") and "tokenizer" in messages[2]
    assert "engine model 0.40 s" in messages[2]
    entries = [json.loads(JsonFormatter("server").format(r)) for r in caplog.records]
    assert [(e["phase"], e["process"]) for e in entries] == [
        ("tokenizer", "server"),
        ("engine model", "server"),
        ("ready", "server"),
    ]
    assert entries[1]["seconds"] == 0.4


def test_a_phase_that_raises_is_not_recorded() -> None:
    phases = StartupPhases(level=None)
    with pytest.raises(KeyboardInterrupt), phases.phase("tokenizer"):
        raise KeyboardInterrupt
    assert phases.phases == []


def test_recording_only_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tokenmill.startup")
    phases = StartupPhases(level=None)
    phases.record("model", 0.1)
    phases.ready()
    assert phases.phases == [("model", 0.1)] and caplog.records == []


def test_the_time_before_the_first_phase_counts_from_the_process_start() -> None:
    phases = StartupPhases(level=None)
    phases.since_process_start("python")
    ((name, seconds),) = phases.phases
    assert name == "python" and 0 < seconds < time.monotonic()  # this process started before the test
    assert phases.ready() >= seconds
