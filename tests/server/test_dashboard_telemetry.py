"""Logs and traces for operators: `--log-format json` writes one JSON object per line, and
`--otlp-traces-endpoint` exports a span per request with queued / prefill / decode children that carry
token counts (never the prompt or the output)."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.server.conftest import run_server
from tokenmill.log_format import LOG_FORMAT_ENV
from tokenmill.metrics.logs import JsonFormatter, use_json_logs
from tokenmill.server.config import ServerConfig

SECRET = "confidential words in the prompt"


def test_json_log_lines_are_one_object_each_with_the_exception() -> None:
    formatter = JsonFormatter()
    record = logging.LogRecord("tokenmill.x", logging.WARNING, __file__, 1, "queue %d deep", (7,), None)
    assert json.loads(formatter.format(record)) | {"time": "t"} == {
        "time": "t",
        "level": "warning",
        "logger": "tokenmill.x",
        "message": "queue 7 deep",
    }
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        failed = logging.LogRecord("tokenmill.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = formatter.format(failed)
    assert "\n" not in line and "RuntimeError: boom" in json.loads(line)["exception"]


def test_use_json_logs_routes_uvicorn_through_the_json_handler(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOG_FORMAT_ENV, "text")  # use_json_logs sets it for child processes; restored after
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        use_json_logs("info")
        logging.getLogger("uvicorn.error").warning("Started server process")
        logging.getLogger("tokenmill.server").warning("engine restarting")
        lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    assert [(x["logger"], x["message"]) for x in lines] == [
        ("uvicorn.error", "Started server process"),
        ("tokenmill.server", "engine restarting"),
    ]


class _Collector(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        _Collector.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_request_spans_reach_an_otlp_endpoint(chat_model: Path) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the otel extra is not installed")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    try:
        with run_server(chat_model, ServerConfig(otlp_traces_endpoint=endpoint)) as running, running.client() as c:
            body = {"prompt": SECRET, "max_tokens": 5, "ignore_eos": True}
            assert c.post("/v1/completions", json=body).status_code == 200
            running.wait_idle()
        # the server's shutdown flushed the batch
    finally:
        collector.shutdown()
    spans = []
    for raw in _Collector.bodies:
        request = ExportTraceServiceRequest.FromString(raw)
        spans += [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"llm_request", "queued", "prefill", "decode"}
    root = by_name["llm_request"]
    for child in ("queued", "prefill", "decode"):
        span = by_name[child]
        assert span.parent_span_id == root.span_id and span.trace_id == root.trace_id
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
    assert by_name["queued"].end_time_unix_nano == by_name["prefill"].start_time_unix_nano
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 5
    assert attrs["gen_ai.usage.input_tokens"].int_value > 0
    decode = {a.key: a.value.int_value for a in by_name["decode"].attributes}
    assert decode == {"tokenmill.output_tokens": 5}
    assert abs(root.start_time_unix_nano / 1e9 - time.time()) < 120  # epoch times, not monotonic ones
    assert SECRET.encode() not in b"".join(_Collector.bodies)
