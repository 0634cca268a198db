"""Anthropic's Messages API: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens.

A request is translated into the chat request the OpenAI route runs (anthropic_chat.py), then goes the
chat route's way: prepare_chat -> admit -> finish (or stream, messages_stream.py); the reply (whole_reply
under its tool plan) comes back as Anthropic's content blocks. Errors take Anthropic's shape
(anthropic_errors.py), so the anthropic SDK raises its own exceptions."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.server.admission import admit
from tokenmill.server.anthropic_chat import chat_request
from tokenmill.server.anthropic_protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from tokenmill.server.anthropic_reply import message_response, new_message_id
from tokenmill.server.chat import prepare_chat
from tokenmill.server.config import ServerState
from tokenmill.server.messages_stream import message_events, stream_frames
from tokenmill.server.openapi_errors import error_responses, streamed
from tokenmill.server.pool.pool import state_for_model
from tokenmill.server.security import request_key
from tokenmill.server.streaming import JobStreamingResponse, finish
from tokenmill.server.tool_output import whole_reply

_ERRORS = error_responses(
    AnthropicErrorResponse,
    s400="Invalid request (invalid_request_error)",
    s401="Missing or wrong API key (authentication_error)",
    s403="The key may not use this model (permission_error)",
    s404="Unknown model (not_found_error)",
    s413="Body too large (request_too_large)",
    s429="Rate limit or full queue, see Retry-After (rate_limit_error)",
    s500="Engine failure (api_error)",
    s503="Shutting down, engine restarting or dead (overloaded_error)",
    s504="Past its deadline (timeout_error)",
)
_SSE = streamed(_ERRORS, "Anthropic's events")


def router(state: ServerState) -> APIRouter:
    api = APIRouter(tags=["anthropic"])

    @api.post("/v1/messages", response_model=MessageResponse, responses=_SSE)
    async def messages(body: MessagesRequest, request: Request) -> Any:
        """Anthropic's Messages API: `anthropic-version` and `x-api-key` (or a Bearer key) are accepted."""
        key = request_key(request.scope)
        async with state_for_model(state, body.model, key) as target:
            return await create_message(target, body, request, key)

    @api.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=_ERRORS)
    async def count_tokens(body: CountTokensRequest, request: Request) -> Any:
        """The prompt's token count as /v1/messages would template it, tools included."""
        key = request_key(request.scope)
        async with state_for_model(state, body.model, key) as target:
            return CountTokensResponse(input_tokens=await _count_tokens(target, body, key))

    return api


async def create_message(state: ServerState, body: MessagesRequest, request: Request, key: str) -> Any:
    arrival = time.monotonic()
    message_id = new_message_id()
    with state.limiter.charging_refusals(key):
        chat = chat_request(body, state.reasoning_parser is not None)
        prepared, plan = await prepare_chat(state, chat, key, message_id)
        job = admit(state, key, [prepared], arrival, chat)
    if body.stream:
        return JobStreamingResponse(state, job, message_events(state, plan, job, message_id), stream_frames)
    await finish(state, job, request)
    out = job.outputs[0].outputs[0]
    reply = whole_reply(plan, out.text, out.finish_reason)
    return JSONResponse(
        message_response(state, job, message_id, reply, out).model_dump(), headers=job.admission.headers
    )


async def _count_tokens(state: ServerState, body: CountTokensRequest, key: str) -> int:
    """The prompt as /v1/messages would run it: prepared as chat prepares it (template, tools, checks),
    never admitted."""
    with state.limiter.charging_refusals(key):
        prepared, _ = await prepare_chat(
            state, chat_request(body, state.reasoning_parser is not None), key, new_message_id()
        )
    return len(prepared.prompt_token_ids)
