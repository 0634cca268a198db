"""POST /v1/score and POST /v1/rerank (the Cohere / Jina shape). A model with a sequence-classification
head (*ForSequenceClassification, one label) scores each (query, document) pair as one input, joined as
its tokenizer joins a pair: the score is the head's logit. Any other model scores by the cosine
similarity of the two texts' embeddings. The response's `method` ("classification" or "cosine") says
which."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.pooling_params import cosine, score_logit
from tokenmill.server.config import ServerState
from tokenmill.server.embeddings_jobs import PoolingResult, run_pooling
from tokenmill.server.embeddings_protocol import (
    EmbeddingUsage,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankResultDocument,
    RerankUsage,
    ScoreData,
    ScoreMethod,
    ScoreRequest,
    ScoreResponse,
)
from tokenmill.server.errors import APIError
from tokenmill.server.openapi_errors import ROUTE_ERRORS
from tokenmill.server.pool.pool import state_for_model
from tokenmill.server.prompts import check_prompt_size
from tokenmill.server.protocol import new_id, now
from tokenmill.server.security import request_key


@dataclass
class Scores:
    values: list[float]
    method: ScoreMethod
    result: PoolingResult


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/score", response_model=ScoreResponse, responses=ROUTE_ERRORS)
    async def score(body: ScoreRequest, request: Request) -> Any:
        key = request_key(request.scope)
        async with state_for_model(state, body.model, key) as target:
            target.check_model(body.model, adapters=False)
            firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
            seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
            if len(firsts) != 1 and len(firsts) != len(seconds):
                raise APIError(
                    400, "text_1 must be one text or as many as text_2 (paired in order).", "invalid_request", "text_1"
                )
            pairs = list(zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds))
            scores = await _score(target, key, pairs, body.priority, request)
            tokens = scores.result.num_prompt_tokens
            response = ScoreResponse(
                id=new_id("score"),
                created=now(),
                model=scores.result.job.model_name or target.model_name,
                method=scores.method,
                data=[ScoreData(index=i, score=s) for i, s in enumerate(scores.values)],
                usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
            )
            return JSONResponse(response.model_dump(), headers=scores.result.job.admission.headers)

    @routes.post("/v1/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ROUTE_ERRORS)
    async def rerank(body: RerankRequest, request: Request) -> Any:
        key = request_key(request.scope)
        async with state_for_model(state, body.model, key) as target:
            target.check_model(body.model, adapters=False)
            documents = body.texts()
            scores = await _score(target, key, [(body.query, d) for d in documents], body.priority, request)
            ranked = sorted(range(len(documents)), key=lambda i: -scores.values[i])[: body.top_n]
            results = [
                RerankResult(
                    index=i,
                    relevance_score=scores.values[i],
                    document=RerankResultDocument(text=documents[i]) if body.return_documents else None,
                )
                for i in ranked
            ]
            response = RerankResponse(
                id=new_id("rerank"),
                model=scores.result.job.model_name or target.model_name,
                method=scores.method,
                results=results,
                usage=RerankUsage(total_tokens=scores.result.num_prompt_tokens),
            )
            headers = scores.result.job.admission.headers
            return JSONResponse(response.model_dump(exclude_none=True), headers=headers)

    return routes


async def _score(state: ServerState, key: str, pairs: list[tuple[str, str]], priority: int, request: Request) -> Scores:
    """Each pair's score: the classification head's logit on the pair, else the cosine similarity of
    the two texts' embeddings (each distinct text embedded once)."""
    if state.engine.pooling.classifier:
        inputs: list[str | list[int]] = [await _pair_ids(state, a, b) for a, b in pairs]
        result = await run_pooling(state, key, new_id("score"), inputs, "classify", priority, None, request)
        try:
            return Scores([score_logit(v) for v in result.vectors], "classification", result)
        except ValueError as exc:
            raise APIError(400, str(exc), "unsupported_model", "model") from exc
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # distinct, in order
    result = await run_pooling(state, key, new_id("score"), list(texts), "embed", priority, None, request)
    vector = dict(zip(texts, result.vectors))
    return Scores([cosine(vector[a], vector[b]) for a, b in pairs], "cosine", result)


async def _pair_ids(state: ServerState, text_1: str, text_2: str) -> list[int]:
    """The pair's token ids, tokenized on the prompt thread (off the event loop)."""
    check_prompt_size(state, text_1 + text_2)
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(state.prompt_pool, state.engine.inputs.pair_token_ids, text_1, text_2)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request") from exc
