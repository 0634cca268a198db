"""--header-read-timeout against slow-loris clients: a connection whose request headers trickle in (or never
come) is closed once the deadline passes, while whole requests, kept-alive connections and slow bodies are
served as before."""

from __future__ import annotations

import argparse
import http.client
import resource
import selectors
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, run_server
from tokenmill.server.cli import add_serve_parser, server_config
from tokenmill.server.config import ServerConfig

HEADER_TIMEOUT_S = 2.0
MARGIN_S = 8.0  # wide: 500 sockets and the server share this process and two cores
NUM_SLOW = 500
BYTE_EVERY_S = 0.5
SLOW_REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100  # never finished
SMALL = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(chat_model: Path) -> Iterator[RunningServer]:
    with run_server(chat_model, ServerConfig(header_read_timeout_s=HEADER_TIMEOUT_S)) as server:
        yield server


@contextmanager
def open_files_at_least(n: int) -> Iterator[None]:
    """Client and server sockets both count against this process's limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return not sock.recv(4096)  # the 408 comes first, then end of stream
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def trickle(socks: list[socket.socket], until: float) -> list[float | None]:
    """Send each socket one more byte of SLOW_REQUEST every BYTE_EVERY_S; return when the server closed
    each one (None: still open at `until`)."""
    closed_at: list[float | None] = [None] * len(socks)
    selector = selectors.DefaultSelector()
    for i, sock in enumerate(socks):
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, i)
    position, next_byte = 1, time.monotonic() + BYTE_EVERY_S
    while selector.get_map() and time.monotonic() < until:
        for key, _ in selector.select(max(0.0, min(next_byte, until) - time.monotonic())):
            if _closed_by_server(socks[key.data]):
                closed_at[key.data] = time.monotonic()
                selector.unregister(key.fileobj)
        if time.monotonic() >= next_byte:
            for key in list(selector.get_map().values()):
                try:
                    socks[key.data].send(SLOW_REQUEST[position : position + 1])
                except OSError:
                    pass  # closed by the server: the selector reports it
            position, next_byte = position + 1, next_byte + BYTE_EVERY_S
    selector.close()
    return closed_at


def test_500_slow_header_clients_are_closed_while_normal_requests_are_served(guarded: RunningServer) -> None:
    assert guarded.server.config.limit_concurrency is None  # no cap of uvicorn's gets to 503 them first
    with guarded.client() as client:  # warm up, so that the requests below are quick
        assert client.post("/v1/completions", json=SMALL).status_code == 200
    with open_files_at_least(4 * NUM_SLOW), ThreadPoolExecutor(1) as pool:
        socks, opened = [], []
        try:
            for _ in range(NUM_SLOW):
                socks.append(socket.create_connection(("127.0.0.1", guarded.server.config.port)))
                socks[-1].sendall(SLOW_REQUEST[:1])
                opened.append(time.monotonic())
            closing = pool.submit(trickle, socks, opened[-1] + HEADER_TIMEOUT_S + MARGIN_S)
            with guarded.client() as client:
                assert client.get("/health").status_code == 200
                assert client.post("/v1/completions", json=SMALL).status_code == 200
            assert len(guarded.server.server_state.connections) >= NUM_SLOW  # served with all 500 held
            closed_at = closing.result()
        finally:
            for sock in socks:
                sock.close()
    waits = [None if closed is None else closed - start for closed, start in zip(closed_at, opened)]
    assert None not in waits, f"{waits.count(None)} of {NUM_SLOW} slow clients were never closed"
    assert all(HEADER_TIMEOUT_S * 0.9 <= w < HEADER_TIMEOUT_S + MARGIN_S for w in waits if w is not None), waits
    with guarded.client() as client:
        assert client.post("/v1/completions", json=SMALL).status_code == 200
    guarded.wait_idle()


def test_headers_that_stall_get_408_and_the_connection_closed(guarded: RunningServer) -> None:
    with socket.create_connection(("127.0.0.1", guarded.server.config.port), timeout=HEADER_TIMEOUT_S + 5) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: headers never end
        response = b""
        while chunk := sock.recv(4096):  # a server without the deadline leaves this to time out
            response += chunk
        elapsed = time.monotonic() - start
    assert response.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), response
    assert b"connection: close" in response
    assert HEADER_TIMEOUT_S * 0.9 <= elapsed < HEADER_TIMEOUT_S + 3


def test_a_connection_that_sends_nothing_is_closed_without_a_response(guarded: RunningServer) -> None:
    with socket.create_connection(("127.0.0.1", guarded.server.config.port), timeout=HEADER_TIMEOUT_S + 5) as sock:
        start = time.monotonic()
        assert sock.recv(4096) == b""
        assert HEADER_TIMEOUT_S * 0.9 <= time.monotonic() - start < HEADER_TIMEOUT_S + 3


def test_a_kept_alive_connection_idle_past_the_header_deadline_serves_its_next_request(
    guarded: RunningServer,
) -> None:
    pause = HEADER_TIMEOUT_S + 1
    assert pause < guarded.server.config.timeout_keep_alive  # idleness is keep-alive's to judge, not ours
    conn = http.client.HTTPConnection("127.0.0.1", guarded.server.config.port, timeout=10)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        local = conn.sock.getsockname()
        time.sleep(pause)
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert response.status == 200 and response.read()
        assert conn.sock.getsockname() == local  # the same connection, not a new one
    finally:
        conn.close()


def test_a_body_slower_than_the_header_deadline_is_served(guarded: RunningServer) -> None:
    body = b'{"model": "%s", "prompt": "Hello", "max_tokens": 2}' % MODEL_NAME.encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", guarded.server.config.port), timeout=10) as sock:
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
        half = len(body) // 2
        for part in (body[:half], body[half:]):  # the body has its own, longer deadline
            time.sleep(HEADER_TIMEOUT_S * 0.75)
            sock.sendall(part)
        response = sock.recv(4096)
    assert response.startswith(b"HTTP/1.1 200"), response
    guarded.wait_idle()


def test_the_flag_parses_and_refuses_non_positive_values() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert server_config(parser.parse_args(["serve"])).header_read_timeout_s == 20.0
    config = server_config(parser.parse_args(["serve", "--header-read-timeout", "2.5"]))
    assert config.header_read_timeout_s == 2.5
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit, match="--header-read-timeout must be a positive number of seconds"):
            server_config(parser.parse_args(["serve", "--header-read-timeout", bad]))
