"""Runtime LoRA adapter loading (vLLM's routes), behind the admin key when one is set (else the API keys):

POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}   check it, then serve it
POST /v1/unload_lora_adapter  {"lora_name": "sql", "drain_timeout": 60}            stop serving it at once;
                              its requests in flight get drain_timeout seconds, then are aborted
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.server.config import ServerState
from tokenmill.server.errors import APIError
from tokenmill.server.lora_modules import LoRAModules
from tokenmill.server.openapi_errors import error_responses
from tokenmill.server.pool.admin import check_admin_key
from tokenmill.server.security import ApiKeys

LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class LoadLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    drain_timeout: float = Field(default=60.0, ge=0.0, le=3600.0)


def lora_router(state: ServerState, loras: LoRAModules, admin_key: str | None) -> APIRouter:
    keys = ApiKeys([admin_key]) if admin_key is not None else None

    def check_admin(request: Request) -> None:
        if keys is not None:  # else the API keys guard these routes, as every other
            check_admin_key(keys, state.throttle, request.scope)

    errors = error_responses(
        s400="A bad adapter (missing, malformed, rank above --max-lora-rank, another base model) or a name taken",
        s401="Missing or wrong key",
        s404="No adapter of that name is loaded",
    )
    router = APIRouter(dependencies=[Depends(check_admin)], tags=["lora"], responses=errors)

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRA) -> Any:
        try:  # reads the adapter's files: off the event loop
            await asyncio.to_thread(loras.check_new, body.lora_name, body.lora_path)
            lora = loras.load(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_lora_adapter", "lora_path") from None
        return {"object": "lora_adapter", "id": lora.lora_name, "parent": state.model_name, "loaded": True}

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRA) -> Any:
        try:
            aborted = await loras.unload(body.lora_name, body.drain_timeout)
        except KeyError:
            raise APIError(
                404, f"no LoRA adapter named {body.lora_name!r} is loaded.", "model_not_found", "lora_name"
            ) from None
        return {"object": "lora_adapter", "id": body.lora_name, "unloaded": True, "aborted_requests": aborted}

    return router
