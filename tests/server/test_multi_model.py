"""Several models behind one server (issue 30): requests routed by name, version and alias to their own
engine, loaded on first use, unloaded when idle or evicted for room, aliases moved (and rolled back) under
load without losing a request, access per API key, the admin API, and a corrupt registry entry."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, engine_args, reseeded_copy, run_server
from tests.tiny_models import make_tiny_model
from tokenmill.registry import Registry
from tokenmill.registry.describe import describe
from tokenmill.server.config import PoolConfig, ServerConfig
from tokenmill.server.pool.access import AccessPolicy
from tokenmill.server.pool.estimate import GIB, kv_cache_bytes, weight_bytes

ADMIN = {"Authorization": "Bearer admin-secret"}
ALL = {"Authorization": "Bearer sk-all"}  # may use every model
ONLY_V1 = {"Authorization": "Bearer sk-v1"}  # may use tiny@1 only
PROMPT = "The capital of France"


@pytest.fixture(scope="module")
def registry(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Registry:
    """tiny@1 (the chat model's weights), tiny@2 (other weights), tiny-stable -> tiny@1; corrupt@1 with a
    rewritten weight file; big@1, too large for the budget test's server; keys in access.json."""
    root = tmp_path_factory.mktemp("registry")
    reg = Registry(root / "reg")
    reg.add("tiny", chat_model, copy=True)
    reg.add("tiny", reseeded_copy(chat_model, root / "v2", seed=1), copy=True)
    reg.set_alias("tiny-stable", "tiny@1")
    corrupt = reg.add("corrupt", chat_model, copy=True)
    weights = corrupt.files_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the sha256 tells
    os.chmod(weights, 0o644)
    weights.write_bytes(bytes(data))
    reg.add("big", make_tiny_model(root / "big", "llama", intermediate_size=4096), copy=True)
    access = {"keys": {"sk-all": ["*"], "sk-v1": ["tiny@1"]}}
    (reg.root / "access.json").write_text(json.dumps(access))
    return reg


@pytest.fixture(scope="module")
def server(chat_model: Path, registry: Registry) -> Iterator[RunningServer]:
    """Pooled engines on threads (quick to start); the default model is the chat model as tiny-chat."""
    pool = PoolConfig(registry=str(registry.root), admin_key="admin-secret")
    with run_server(chat_model, ServerConfig(engine_in_thread=True, models=pool)) as running:
        yield running


def complete(client: httpx.Client, model: str, headers: dict[str, str] = ALL, **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True} | fields
    return client.post("/v1/completions", json=body, headers=headers)


def status(client: httpx.Client, model_id: str) -> str:
    cards = client.get("/v1/models", headers=ALL).json()["data"]
    return next(c["state"] for c in cards if c["id"] == model_id)


def test_requests_by_version_name_and_alias_reach_their_model(server: RunningServer) -> None:
    with server.client() as c:
        assert status(c, "tiny@1") == "not_loaded"
        by_id = {m: complete(c, m).json() for m in ("tiny@1", "tiny@2", "tiny", "tiny-stable", MODEL_NAME)}
        assert status(c, "tiny@1") == "ready"  # loaded by its first request
    served = {m: (r["model"], r["choices"][0]["text"]) for m, r in by_id.items()}
    assert served["tiny@1"][0] == "tiny@1" and served["tiny@2"][0] == "tiny@2"
    assert served["tiny"] == served["tiny@2"]  # a bare name: its highest version
    assert served["tiny-stable"] == served["tiny@1"]  # an alias: its target
    assert served["tiny@1"][1] != served["tiny@2"][1]  # two different models answered
    assert served[MODEL_NAME] == (MODEL_NAME, served["tiny@1"][1])  # the default model: tiny@1's weights


def test_models_lists_every_servable_id_with_version_aliases_and_state(server: RunningServer) -> None:
    with server.client() as c:
        complete(c, "tiny@1")
        cards = {card["id"]: card for card in c.get("/v1/models", headers=ALL).json()["data"]}
    assert {"tiny-chat", "tiny@1", "tiny@2", "tiny", "tiny-stable", "corrupt@1", "big@1"} <= set(cards)
    assert cards["tiny-stable"]["root"] == "tiny@1" and cards["tiny-stable"]["version"] == "1"
    assert cards["tiny@1"]["aliases"] == ["tiny-stable"] and cards["tiny@1"]["state"] == "ready"
    assert cards["tiny"]["root"] == "tiny@2"
    assert cards["big@1"]["state"] == "not_loaded"


def test_load_time_is_a_metric_and_each_model_keeps_its_label(server: RunningServer) -> None:
    with server.client() as c:
        complete(c, "tiny@2")
        page = c.get("/metrics", headers=ALL).text
    assert 'tokenmill:model_load_seconds_count{model_name="tiny@2"} 1.0' in page
    assert 'tokenmill:generation_tokens_total{model_name="tiny@2"}' in page
    assert 'tokenmill:generation_tokens_total{model_name="tiny-chat"}' in page
    assert page.count("# TYPE tokenmill:generation_tokens_total counter") == 1  # one family, two models


def test_access_control_404_for_unknown_and_403_for_a_model_the_key_may_not_use(server: RunningServer) -> None:
    with server.client() as c:
        unknown = complete(c, "no-such-model", ONLY_V1)
        forbidden = complete(c, "tiny@2", ONLY_V1)
        alias_of_allowed = complete(c, "tiny-stable", ONLY_V1)
        listed = {card["id"] for card in c.get("/v1/models", headers=ONLY_V1).json()["data"]}
        no_key = complete(c, "tiny@1", {})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "model_not_allowed"
    assert alias_of_allowed.status_code == 200 and alias_of_allowed.json()["model"] == "tiny@1"
    assert listed == {"tiny@1", "tiny-stable"}  # a key sees what it may use
    assert no_key.status_code == 401


def test_admin_routes_need_the_admin_key(server: RunningServer) -> None:
    with server.client() as c:
        assert c.get("/admin/models").status_code == 401
        assert c.get("/admin/models", headers=ALL).status_code == 401  # an API key is not the admin key
        assert c.post("/admin/models/load", json={"model": "tiny@2"}, headers=ALL).status_code == 401
        listing = c.get("/admin/models", headers=ADMIN)
    assert listing.status_code == 200
    assert any(m["id"] == MODEL_NAME and m["pinned"] for m in listing.json()["data"])


def test_corrupt_entry_is_a_clear_error_and_the_others_keep_serving(server: RunningServer, registry: Registry) -> None:
    with server.client() as c:
        broken = complete(c, "corrupt@1")
        fine = complete(c, "tiny@1")
        state = status(c, "corrupt@1")
    assert broken.status_code == 500
    error = broken.json()["error"]
    assert error["code"] == "model_corrupt" and "tokenmill models verify corrupt@1" in error["message"]
    assert str(registry.root) not in error["message"] and "sha256" not in error["message"]  # the detail: the log
    assert state == "not_loaded"
    assert fine.status_code == 200 and fine.json()["model"] == "tiny@1"


def test_alias_moved_under_load_loses_no_request_and_rolls_back(server: RunningServer) -> None:
    with server.client() as c:
        expected = {m: complete(c, m, max_tokens=24).json()["choices"][0]["text"] for m in ("tiny@1", "tiny@2")}
        results: list[httpx.Response] = []
        stop = threading.Event()

        def fire() -> None:
            with server.client() as own:
                while not stop.is_set():
                    results.append(complete(own, "tiny-stable", max_tokens=24))

        threads = [threading.Thread(target=fire) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        moved = c.put("/admin/aliases/tiny-stable", json={"model": "tiny@2", "unload_previous": True}, headers=ADMIN)
        time.sleep(0.5)
        back = c.put("/admin/aliases/tiny-stable", json={"model": "tiny@1", "unload_previous": True}, headers=ADMIN)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(30)
        after = complete(c, "tiny-stable")
    assert moved.status_code == 200 and moved.json() == {
        "alias": "tiny-stable",
        "model": "tiny@2",
        "previous": "tiny@1",
        "unloaded": "tiny@1",
    }
    assert back.status_code == 200 and back.json()["unloaded"] == "tiny@2"
    assert results and all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    # Each request ran on one version from start to end: its text is that version's, whole.
    assert all(r.json()["choices"][0]["text"] == expected[r.json()["model"]] for r in results)
    assert {r.json()["model"] for r in results} == {"tiny@1", "tiny@2"}
    assert after.json()["model"] == "tiny@1"


# --------------------------------------------------------------------------- on demand, in processes


def model_bytes(path: Path) -> int:
    args = engine_args(path)
    info = describe(path)
    return weight_bytes(info.parameters, info.dtype, 0, args) + kv_cache_bytes(path, args)


@pytest.fixture(scope="module")
def budget_server(chat_model: Path, registry: Registry) -> Iterator[RunningServer]:
    """Engines in processes of their own; room for the default model and one more; idle ones unload after 3 s."""
    one = model_bytes(chat_model)
    pool = PoolConfig(registry=str(registry.root), keep_alive_s=3.0, memory_budget_gb=2.5 * one / GIB)
    with run_server(chat_model, ServerConfig(models=pool)) as running:
        yield running


def engine_pid(server: RunningServer, model_id: str) -> int:
    assert server.state.models is not None
    model = next(m for m in server.state.models.loaded() if m.entry.id == model_id)
    assert model.pid is not None
    return model.pid


def wait_exit(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_budget_evicts_the_least_recently_used_idle_model_and_refuses_one_that_cannot_fit(
    budget_server: RunningServer,
) -> None:
    with budget_server.client() as c:
        assert complete(c, "tiny@1").status_code == 200
        first = engine_pid(budget_server, "tiny@1")
        assert complete(c, "tiny@2").json()["model"] == "tiny@2"  # no room for both: tiny@1 makes way
        states = {m: status(c, m) for m in ("tiny@1", "tiny@2")}
        too_big = complete(c, "big@1")
    assert states == {"tiny@1": "not_loaded", "tiny@2": "ready"}
    assert wait_exit(first)  # its engine process is gone, and its memory with it
    assert too_big.status_code == 503 and too_big.headers["Retry-After"]
    assert too_big.json()["error"]["code"] == "model_does_not_fit" and "big@1" in too_big.json()["error"]["message"]


def test_idle_model_unloads_after_keep_alive_and_its_process_exits(budget_server: RunningServer) -> None:
    with budget_server.client() as c:
        assert complete(c, "tiny@2").status_code == 200
        pid = engine_pid(budget_server, "tiny@2")
        assert wait_exit(pid, timeout=10.0)
        assert status(c, "tiny@2") == "not_loaded"
        assert status(c, MODEL_NAME) == "ready"  # the default model stays
        page = c.get("/metrics", headers=ALL).text
    assert 'tokenmill:model_unload_seconds_count{model_name="tiny@2"}' in page
    assert "tokenmill:models_loaded 1.0" in page


# --------------------------------------------------------------------------- without a registry


def test_extra_models_are_served_by_name_and_max_loaded_models_evicts(chat_model: Path, tmp_path: Path) -> None:
    other = reseeded_copy(chat_model, tmp_path / "other", seed=1)
    pool = PoolConfig(extra_models=(("a", str(chat_model)), ("b", str(other))), max_loaded_models=2)
    with run_server(chat_model, ServerConfig(engine_in_thread=True, models=pool)) as running, running.client() as c:
        a = complete(c, "a", {})
        b = complete(c, "b", {})
        states = {card["id"]: card["state"] for card in c.get("/v1/models").json()["data"]}
        unknown = complete(c, "tiny@1", {})
        no_registry = c.put("/admin/aliases/x", json={"model": "a"})
    assert a.json()["model"] == "a" and b.json()["model"] == "b"
    assert a.json()["choices"][0]["text"] != b.json()["choices"][0]["text"]
    assert states == {MODEL_NAME: "ready", "a": "not_loaded", "b": "ready"}  # two resident: the default and b
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert no_registry.status_code == 401  # no --admin-key: the admin API is off


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"keep_alive_s": 0}, "--keep-alive"),
        ({"max_loaded_models": 0}, "--max-loaded-models"),
        ({"memory_budget_gb": -1.0}, "--memory-budget-gb"),
        ({"extra_models": (("a", "x"), ("a", "y"))}, "--extra-model"),
        ({"max_loading_models": 0}, "--max-loading-models"),
        ({"model_loads_per_hour": -1}, "--model-loads-per-hour"),
    ],
)
def test_pool_settings_are_checked(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PoolConfig(**fields)


@pytest.mark.parametrize(
    "content", ["not json", '{"keys": {}}', '{"keys": {"sk": "smol"}}', '["smol"]', '{"keys": {" ": ["smol"]}}']
)
def test_a_malformed_access_config_is_a_clear_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "access.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="access config"):
        AccessPolicy.load(path)


def test_access_patterns_match_the_requested_id_its_version_or_its_name() -> None:
    policy = AccessPolicy({"sk": ("smol", "team-*")})
    assert policy.allows(policy.patterns["sk"], ("smol-stable", "smol@2", "smol"))
    assert policy.allows(policy.patterns["sk"], ("team-x@1", "team-x@1", "team-x"))
    assert not policy.allows(policy.patterns["sk"], ("other", "other@1", "other"))
