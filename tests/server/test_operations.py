"""Operations: TLS, no file paths in /v1/models, lone surrogates, allowed Host names (DNS rebinding) and
CORS."""

from __future__ import annotations

import argparse
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, run_server
from tokenmill.server.cli import add_serve_parser, server_config
from tokenmill.server.config import ServerConfig
from tokenmill.server.hosts import allowed_hosts, host_allowed
from tokenmill.server.launcher import print_usage

ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def local(chat_model: Path) -> Iterator[RunningServer]:
    """A key-less server on loopback, with CORS for ORIGIN."""
    with run_server(chat_model, ServerConfig(allowed_origins=(ORIGIN,))) as running:
        yield running


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1, and its key (with openssl; the tests skip without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command (the cryptography package is not installed either)")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls(chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = self_signed(tmp_path)
    config = ServerConfig(ssl_certfile=str(cert), ssl_keyfile=str(key))
    with run_server(chat_model, config) as running:
        port = running.server.bound_port()
        trusted = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=trusted, timeout=30) as client:
            assert client.get("/health").status_code == 200
            r = client.get("/v1/models", headers={"origin": ORIGIN})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # no CORS by default
            r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
        with pytest.raises(httpx.HTTPError):  # plain http to a TLS port gets no answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        print_usage(running.server)
        assert f"https://127.0.0.1:{port}/v1" in capsys.readouterr().out


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_tls_needs_both_files() -> None:
    with pytest.raises(SystemExit, match="--ssl-keyfile"):
        server_config(serve_args("--ssl-certfile", "cert.pem"))
    with pytest.raises(ValueError, match="--ssl-certfile"):
        ServerConfig(ssl_keyfile="key.pem")
    config = server_config(
        serve_args("--ssl-certfile", "c", "--ssl-keyfile", "k", "--ssl-ca-certs", "ca", "--ssl-cert-reqs", "2")
    )
    assert (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, config.ssl_cert_reqs) == ("c", "k", "ca", 2)


def test_models_show_no_paths(local: RunningServer, chat_model: Path) -> None:
    with local.client() as client:
        r = client.get("/v1/models")
    assert r.status_code == 200
    assert str(chat_model) not in r.text and chat_model.name not in r.text
    (card,) = r.json()["data"]
    assert card["id"] == MODEL_NAME
    assert all("/" not in str(value) for value in card.values()), card


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", '{"model": "tiny-chat", "prompt": "\\ud800", "max_tokens": 2}'),
        ("/v1/completions", '{"model": "tiny-chat", "prompt": "a\\ud800b", "max_tokens": 2, "echo": true}'),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2, "echo": true, "stream": true}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], "stream": true}',
        ),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stop": "\\ud800"}'),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "user": "\\ud800"}'),
        ("/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'),
        ("/v1/responses", '{"model": "tiny-chat", "input": "\\ud800", "max_output_tokens": 2}'),
        (
            "/v1/messages",
            '{"model": "tiny-chat", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}',
        ),
        ("/v1/embeddings", '{"model": "tiny-chat", "input": "\\ud800"}'),
        ("/v1/rerank", '{"model": "tiny-chat", "query": "\\ud800", "documents": ["a"]}'),
    ],
)
def test_lone_surrogate_is_a_400(local: RunningServer, path: str, body: str) -> None:
    with local.client() as client:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "surrogate" in r.json()["error"]["message"]


def test_surrogate_pair_is_text(local: RunningServer) -> None:
    body = '{"model": "tiny-chat", "prompt": "\\ud83d\\ude00", "max_tokens": 2, "echo": true}'
    with local.client() as client:
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("\U0001f600")


def test_loopback_server_answers_loopback_hosts_only(local: RunningServer) -> None:
    port = local.server.bound_port()
    with local.client() as client:
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST", "localhost."):
            assert client.get("/v1/models", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io"):
            r = client.get("/v1/models", headers={"host": host})
            assert r.status_code == 400, host
            assert r.json()["error"]["code"] == "invalid_host"
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"host": "evil.example"})
        assert r.status_code == 400
        assert client.get("/health", headers={"host": "evil.example"}).status_code == 400


def test_allowed_hosts_rules() -> None:
    assert allowed_hosts("0.0.0.0", ()) is None  # beyond loopback: any Host (with a start-up warning)
    assert allowed_hosts("127.0.0.1", ("*",)) is None
    assert allowed_hosts("127.0.0.2", ()) == ("localhost", "127.0.0.1", "::1", "127.0.0.2")
    hosts = allowed_hosts("0.0.0.0", ("api.example.com", "*.internal"))
    assert hosts is not None
    assert host_allowed("API.example.com:443", hosts) and host_allowed("a.b.internal", hosts)
    assert not host_allowed("localhost", hosts) and not host_allowed("internal.evil", hosts)
    assert not host_allowed("", hosts)
    config = server_config(serve_args("--allowed-hosts", "a.com,b.com", "--allowed-hosts", "c.com"))
    assert config.allowed_hosts == ("a.com", "b.com", "c.com")


def test_cors_only_for_allowed_origins(local: RunningServer) -> None:
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    with local.client() as client:
        r = client.get("/v1/models", headers={"origin": ORIGIN})
        assert r.headers["access-control-allow-origin"] == ORIGIN
        r = client.options("/v1/chat/completions", headers={"origin": ORIGIN, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = client.get("/v1/models", headers={"origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        r = client.options("/v1/chat/completions", headers={"origin": "https://evil.example", **preflight})
        assert "access-control-allow-origin" not in r.headers
