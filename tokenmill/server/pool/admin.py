"""The admin API (/admin/...), behind the admin key ($TOKENMILL_ADMIN_KEY, --admin-key-file or --admin-key)
rather than the API keys, through the same failed-login throttle; each call is a line of --audit-log:

    POST /admin/models/load    {"model": "smol@2"}                 load now (the first request then waits for nothing)
    POST /admin/models/unload  {"model": "smol@1"}                 drain its requests, then stop its engine
    PUT  /admin/aliases/ALIAS  {"model": "smol@1", "unload_previous": true}
                                move an alias (atomic for new requests); optionally drain and unload the old target
    GET  /admin/models                                             what is loaded: state, requests, memory estimate

Moving an alias back to the version it left is a rollback: requests already on the newer version finish there.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from tokenmill.registry import RegistryError, UnknownModelError
from tokenmill.server.audit import note_model
from tokenmill.server.config import ADMIN_KEY_ENV
from tokenmill.server.errors import APIError
from tokenmill.server.openapi_errors import error_responses
from tokenmill.server.pool.pool import LoadedModel, ModelPool
from tokenmill.server.security import ApiKeys, LoginThrottle, authenticate, authorization, client_address

ADMIN_PREFIX = "/admin/"


class ModelAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    drain_timeout: float | None = None  # unload: seconds its requests get before they are aborted


class AliasMove(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    unload_previous: bool = False  # drain and unload the version the alias pointed at


def check_admin_key(keys: ApiKeys, throttle: LoginThrottle, scope: Mapping[str, Any]) -> None:
    """Raise the admin API's APIError unless the request carries the admin key (through the same
    failed-login throttle as the API keys). The server's admin routes and the fleet's ingress use it."""
    if not keys.enabled:
        raise APIError(401, f"the admin API is off: start the server with ${ADMIN_KEY_ENV}.", "invalid_admin_key")
    try:
        authenticate(keys, throttle, client_address(scope), authorization(scope["headers"]))
    except APIError as exc:
        if exc.status != 401:
            raise
        raise APIError(
            401,
            "missing or wrong admin key: send 'Authorization: Bearer ADMIN_KEY'.",
            "invalid_admin_key",
            headers={"WWW-Authenticate": "Bearer"},
        ) from None


def admin_router(pool: ModelPool, admin_key: str | None, throttle: LoginThrottle) -> APIRouter:
    keys = ApiKeys([admin_key] if admin_key is not None else [])

    def check_admin(request: Request) -> None:
        check_admin_key(keys, throttle, request.scope)

    # In the schema (tagged "admin") so that clients and the schema fuzz know every answer it may send.
    errors = error_responses(
        s401="Missing or wrong admin key, or the admin API is off",
        s404="Unknown model or version",
        s409="Not loaded, or the pinned default model",
        s429="Too many failed admin logins (see Retry-After)",
        s500="The model failed to load (the server's log has the reason)",
        s503="Shutting down, registry busy, or no room to load",
    )
    router = APIRouter(prefix="/admin", dependencies=[Depends(check_admin)], tags=["admin"], responses=errors)

    @router.get("/models")
    async def loaded() -> dict[str, Any]:
        return {"data": [_describe(m) for m in pool.loaded()]}

    @router.post("/models/load")
    async def load(body: ModelAction, request: Request) -> dict[str, Any]:
        note_model(request.scope, body.model)
        started = time.monotonic()
        model = await pool.load(body.model)
        return _describe(model) | {"seconds": round(time.monotonic() - started, 3)}

    @router.post("/models/unload")
    async def unload(body: ModelAction, request: Request) -> dict[str, Any]:
        note_model(request.scope, body.model)
        started = time.monotonic()
        model = await pool.unload(body.model, body.drain_timeout)
        return _describe(model) | {"seconds": round(time.monotonic() - started, 3)}

    @router.put("/aliases/{alias}")
    async def move_alias(alias: str, body: AliasMove, request: Request) -> dict[str, Any]:
        note_model(request.scope, body.model)
        try:
            target, previous = await pool.catalog.move_alias(alias, body.model)
        except UnknownModelError as exc:
            raise APIError(404, str(exc), "model_not_found", "model") from None
        except RegistryError as exc:
            raise APIError(400, str(exc), "invalid_alias") from None
        unloaded = None
        if body.unload_previous and previous is not None and previous != target.id:
            if pool.status(previous) != "not_loaded":
                unloaded = _describe(await pool.unload(previous))["id"]
        return {"alias": alias, "model": target.id, "previous": previous, "unloaded": unloaded}

    return router


def _describe(model: LoadedModel) -> dict[str, Any]:
    state = model.state
    return {
        "id": model.entry.id,
        "state": model.status,
        "pinned": model.pinned,
        "requests": state.engine.num_in_flight if state is not None and model.status != "not_loaded" else 0,
        "estimate_bytes": model.estimate_bytes,
        "load_seconds": model.load_seconds,
        "pid": model.pid,
    }
