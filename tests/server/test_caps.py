"""Caps against cheap-to-send, costly-to-serve requests: logit_bias entries (--max-logit-bias), open
connections (--limit-concurrency, uvicorn's 503) and slow bodies (--body-read-timeout, 408)."""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, run_server
from tokenmill.server.cli import add_serve_parser, server_config
from tokenmill.server.config import ServerConfig

SMALL = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def capped(chat_model: Path) -> Iterator[RunningServer]:
    config = ServerConfig(limit_concurrency=2, body_read_timeout_s=READ_TIMEOUT_S)
    with run_server(chat_model, config) as server:
        yield server


def _bias(n: int) -> dict[str, float]:
    return {str(i): 0.5 for i in range(n)}


def test_logit_bias_over_the_default_cap_is_refused_and_at_the_cap_served(capped: RunningServer) -> None:
    cap = ServerConfig().max_logit_bias
    assert cap == 300  # OpenAI's own cap
    with capped.client() as client:
        r = client.post("/v1/completions", json={**SMALL, "logit_bias": _bias(cap + 1)})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "logit_bias_too_large" and error["param"] == "logit_bias"
        assert str(cap) in error["message"]
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = client.post("/v1/chat/completions", json={**chat, "logit_bias": _bias(cap + 1)})
        assert r.status_code == 400 and r.json()["error"]["code"] == "logit_bias_too_large"
        assert client.post("/v1/completions", json={**SMALL, "logit_bias": _bias(cap)}).status_code == 200
        assert client.post("/v1/chat/completions", json={**chat, "logit_bias": _bias(cap)}).status_code == 200
    capped.wait_idle()


def test_limit_concurrency_reaches_uvicorn_and_answers_503(capped: RunningServer) -> None:
    assert capped.server.config.limit_concurrency == 2
    with capped.client() as client:
        assert client.post("/v1/completions", json=SMALL).status_code == 200
    # One idle connection held open, and a request on a second one is one connection too many.
    with socket.create_connection(("127.0.0.1", capped.server.config.port)) as idle:
        idle.sendall(b"GET /health HTTP/1.1\r\n")  # headers begun, never finished
        deadline = time.monotonic() + 10
        while len(capped.server.server_state.connections) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with capped.client() as client:
            r = client.post("/v1/completions", json=SMALL)
            assert r.status_code == 503, r.text
    deadline = time.monotonic() + 10
    while capped.server.server_state.connections:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with capped.client() as client:
        assert client.post("/v1/completions", json=SMALL).status_code == 200
    capped.wait_idle()


def test_a_body_that_does_not_arrive_in_time_gets_408(capped: RunningServer) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", capped.server.config.port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(head + b'{"model": "')  # headers and a tenth of the body, then silence
        response = b""
        while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)  # a server without the deadline leaves this to time out
            if not chunk:
                break
            response += chunk
        elapsed = time.monotonic() - start
    assert response.startswith(b"HTTP/1.1 408"), response
    assert b"request_timeout" in response
    assert READ_TIMEOUT_S * 0.8 <= elapsed < READ_TIMEOUT_S + 3
    with capped.client() as client:  # the server is fine, and a whole body in time is served
        assert client.post("/v1/completions", json=SMALL).status_code == 200
    capped.wait_idle()


def test_the_flags_parse_into_the_server_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    defaults = server_config(parser.parse_args(["serve"]))
    assert (defaults.max_logit_bias, defaults.limit_concurrency, defaults.body_read_timeout_s) == (300, None, 30.0)
    args = ["serve", "--max-logit-bias", "5", "--limit-concurrency", "3", "--body-read-timeout", "2.5"]
    config = server_config(parser.parse_args(args))
    assert (config.max_logit_bias, config.limit_concurrency, config.body_read_timeout_s) == (5, 3, 2.5)
    for bad in (["--limit-concurrency", "0"], ["--body-read-timeout", "0"], ["--max-logit-bias", "-1"]):
        with pytest.raises(SystemExit):
            server_config(parser.parse_args(["serve", *bad]))
