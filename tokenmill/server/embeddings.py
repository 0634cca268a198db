"""POST /v1/embeddings (OpenAI's shape): each input's final hidden state, pooled as the model's folder
says (its sentence-transformers pooling config, else the last token), L2-normalized; `dimensions` keeps
the first values and normalizes again; "base64" sends little-endian float32 bytes, as the openai SDK
decodes them. Batched with other traffic as prefill-only requests that keep no KV cache."""

from __future__ import annotations

import base64
import struct
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.pooling_params import check_dimensions, truncate_embedding
from tokenmill.server import rerank
from tokenmill.server.config import ServerState
from tokenmill.server.embeddings_jobs import PoolingResult, check_pooling, run_pooling
from tokenmill.server.embeddings_protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from tokenmill.server.errors import APIError
from tokenmill.server.openapi_errors import ROUTE_ERRORS
from tokenmill.server.pool.pool import state_for_model
from tokenmill.server.protocol import new_id
from tokenmill.server.security import request_key


def router(state: ServerState) -> APIRouter:
    """/v1/embeddings, and /v1/score and /v1/rerank (rerank.py), which pool the same way."""
    routes = APIRouter()
    routes.include_router(rerank.router(state))

    @routes.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ROUTE_ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        key = request_key(request.scope)
        async with state_for_model(state, body.model, key) as target:
            result = await _embed(target, body, key, request)
            response = _response(target, body, result)
            return JSONResponse(response.model_dump(), headers=result.job.admission.headers)

    return routes


async def embeddings_response(state: ServerState, body: EmbeddingRequest, key: str) -> EmbeddingResponse:
    """The reply to an embeddings request run without HTTP (the Batch API's lines): errors as APIError."""
    return _response(state, body, await _embed(state, body, key, None))


async def _embed(state: ServerState, body: EmbeddingRequest, key: str, request: Request | None) -> PoolingResult:
    state.check_model(body.model, adapters=False)
    check_pooling(state, "embed")
    try:
        check_dimensions(body.dimensions, state.engine.pooling.hidden_size)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_dimensions", "dimensions") from exc
    salt = state.cache_salt(key, body.cache_salt)
    return await run_pooling(state, key, new_id("embd"), body.inputs(), "embed", body.priority, salt, request)


def _response(state: ServerState, body: EmbeddingRequest, result: PoolingResult) -> EmbeddingResponse:
    data = []
    for i, vector in enumerate(result.vectors):
        values = truncate_embedding(vector, body.dimensions)
        embedding: list[float] | str = values if body.encoding_format == "float" else _base64(values)
        data.append(EmbeddingData(index=i, embedding=embedding))
    tokens = result.num_prompt_tokens
    usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    return EmbeddingResponse(data=data, model=result.job.model_name or state.model_name, usage=usage)


def _base64(values: list[float]) -> str:
    """Little-endian float32 bytes, base64: what the openai SDK decodes (numpy's frombuffer, "<f4")."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
