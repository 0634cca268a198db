"""Prefix-cache isolation between tenants: the `cache_salt` extension field, and
`--prefix-cache-isolation per-key`, which salts every request with its API key so that one key's
identical prompt neither hits nor reveals (through hit counters or latency) another key's cache."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import RunningServer, run_server
from tokenmill.server.cli import add_serve_parser, server_config
from tokenmill.server.config import ServerConfig

KEYS = ("key-a", "key-b")
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(64)]  # several full blocks


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cached_tokens(server: RunningServer, key: str, path: str = "/v1/completions", **extra: Any) -> int:
    """The prompt tokens the request found in the prefix cache (the engine's cumulative hit counter's rise)."""
    server.wait_idle()
    before = server.engine.snapshot.prefix_cache_hits
    if path == "/v1/completions":
        body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True, **extra}
    else:
        body = {"messages": [{"role": "user", "content": "The quick brown fox " * 12}], "max_tokens": 2, **extra}
    with server.client() as client:
        r = client.post(path, json=body, headers=auth(key))
    assert r.status_code == 200, r.text
    server.wait_idle()
    return server.engine.snapshot.prefix_cache_hits - before


def empty_cache(server: RunningServer) -> None:
    server.wait_idle()
    server.core.kv_cache.pool.reset_prefix_cache()  # every block is free once idle: forget them all


@pytest.fixture(scope="module")
def per_key(chat_model: Path) -> Iterator[RunningServer]:
    with run_server(chat_model, ServerConfig(api_keys=KEYS, prefix_cache_isolation="per-key")) as server:
        yield server


@pytest.fixture(scope="module")
def shared(chat_model: Path) -> Iterator[RunningServer]:
    with run_server(chat_model, ServerConfig(api_keys=KEYS)) as server:
        yield server


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_per_key_a_second_keys_identical_prompt_misses_and_the_same_keys_repeat_hits(
    per_key: RunningServer, path: str
) -> None:
    empty_cache(per_key)
    assert cached_tokens(per_key, "key-a", path) == 0
    assert cached_tokens(per_key, "key-b", path) == 0  # another tenant: no hit
    assert cached_tokens(per_key, "key-a", path) > 0  # the same tenant's repeat hits
    assert cached_tokens(per_key, "key-b", path) > 0


def test_per_key_a_request_salt_cannot_reach_into_another_key(per_key: RunningServer) -> None:
    empty_cache(per_key)
    assert cached_tokens(per_key, "key-a", cache_salt="x") == 0
    assert cached_tokens(per_key, "key-b", cache_salt="x") == 0  # same salt, other key: still apart
    assert cached_tokens(per_key, "key-a") == 0  # the key's own salt-less namespace is another one
    assert cached_tokens(per_key, "key-a", cache_salt="x") > 0


def test_shared_cache_is_shared_across_keys_unless_salted(shared: RunningServer) -> None:
    empty_cache(shared)
    assert cached_tokens(shared, "key-a") == 0
    assert cached_tokens(shared, "key-b") > 0  # the default: one cache for everyone
    assert cached_tokens(shared, "key-b", cache_salt="mine") == 0
    assert cached_tokens(shared, "key-a", cache_salt="other") == 0
    assert cached_tokens(shared, "key-a", cache_salt="mine") > 0  # the same salt shares, whatever the key


def test_an_empty_or_non_string_cache_salt_is_400(shared: RunningServer) -> None:
    with shared.client() as client:
        for salt in ("", 5):
            for path, body in (
                ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
            ):
                r = client.post(path, json={**body, "cache_salt": salt}, headers=auth("key-a"))
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "cache_salt"


def test_the_switch_on_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert server_config(parser.parse_args(["serve", "m"])).prefix_cache_isolation == "shared"
    args = parser.parse_args(["serve", "m", "--prefix-cache-isolation", "per-key"])
    assert server_config(args).prefix_cache_isolation == "per-key"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--prefix-cache-isolation", "none"])
    with pytest.raises(ValueError, match="prefix-cache-isolation"):
        ServerConfig(prefix_cache_isolation="none")


def test_per_key_isolation_holds_with_the_engine_in_its_own_process(chat_model: Path) -> None:
    """As `tokenmill serve` runs: the salt must cross the pipe to the engine process."""
    config = ServerConfig(api_keys=KEYS, prefix_cache_isolation="per-key")
    with run_server(chat_model, config, engine_process=True) as server:
        assert cached_tokens(server, "key-a") == 0
        assert cached_tokens(server, "key-b") == 0
        assert cached_tokens(server, "key-a") > 0
