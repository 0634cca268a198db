"""The admin API's key: from $TOKENMILL_ADMIN_KEY, --admin-key-file or --admin-key (one source,
config.py), checked through the same failed-login throttle as the API keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenmill.server.config import ADMIN_KEY_ENV, PoolConfig
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.pool.admin import admin_router
from tokenmill.server.pool.pool import ModelPool
from tokenmill.server.security import LoginThrottle


class _NoModels:
    def loaded(self) -> list[Any]:
        return []


def _client(throttle: LoginThrottle, admin_key: str | None = "adm") -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_router(cast(ModelPool, _NoModels()), admin_key, throttle))
    return TestClient(app)


def _get(client: TestClient, key: str) -> int:
    return client.get("/admin/models", headers={"Authorization": f"Bearer {key}"}).status_code


def test_wrong_admin_keys_are_throttled() -> None:
    client = _client(LoginThrottle(max_failures=3))
    assert _get(client, "adm") == 200
    assert [_get(client, "guess") for _ in range(4)] == [401, 401, 401, 429]
    assert _get(client, "adm") == 200  # it logged in from this address before the lock


def test_a_locked_address_cannot_try_the_admin_key() -> None:
    client = _client(LoginThrottle(max_failures=2))
    assert [_get(client, "guess") for _ in range(2)] == [401, 401]
    r = client.get("/admin/models", headers={"Authorization": "Bearer adm"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_failed_logins"


def test_wrong_key_answer_names_the_admin_key() -> None:
    r = _client(LoginThrottle()).get("/admin/models", headers={"Authorization": "Bearer guess"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
    off = _client(LoginThrottle(), admin_key=None).get("/admin/models", headers={"Authorization": "Bearer x"})
    assert off.status_code == 401 and ADMIN_KEY_ENV in off.json()["error"]["message"]


def test_the_admin_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_KEY_ENV, " from-env ")
    assert PoolConfig().resolved_admin_key() == "from-env"
    assert PoolConfig(admin_key="from-flag").resolved_admin_key() == "from-flag"
    monkeypatch.delenv(ADMIN_KEY_ENV)
    assert PoolConfig().resolved_admin_key() is None


def test_the_admin_key_comes_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_KEY_ENV, "from-env")
    path = tmp_path / "admin.key"
    path.write_text("from-file\n")
    assert PoolConfig(admin_key_file=str(path)).resolved_admin_key() == "from-file"
    path.write_text("\n")
    with pytest.raises(ValueError, match="first line is empty"):
        PoolConfig(admin_key_file=str(path)).resolved_admin_key()
    with pytest.raises(ValueError, match="cannot read"):
        PoolConfig(admin_key_file=str(tmp_path / "missing")).resolved_admin_key()
    with pytest.raises(ValueError, match="not both"):
        PoolConfig(admin_key="k", admin_key_file=str(path))
