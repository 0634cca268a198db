"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items.

A thin translation onto the chat pipeline (responses_translate.py): the input items, after those of
`previous_response_id`, become a chat request that goes prepare_chat -> admit -> finish (or stream) ->
chat_response, as /v1/chat/completions does. Responses are stored (`store`, default true) in memory, per
API key (response_store.py). `background: true` answers at once with status "queued"; the response runs
on and is read with GET; cancel stops it, as it stops a stream still running."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from tokenmill.server.admission import admit
from tokenmill.server.chat import chat_response, prepare_chat
from tokenmill.server.config import ServerState
from tokenmill.server.errors import INTERNAL_ERROR_MESSAGE, APIError
from tokenmill.server.job import Job, close
from tokenmill.server.openapi_errors import error_responses, streamed
from tokenmill.server.pool.pool import state_for_model
from tokenmill.server.protocol import ChatCompletionRequest, now
from tokenmill.server.response_store import ResponseStore, StoredResponse
from tokenmill.server.responses_protocol import (
    DeletedResponse,
    InputItemList,
    Item,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
)
from tokenmill.server.responses_stream import response_events
from tokenmill.server.responses_translate import (
    chat_request,
    echoed_settings,
    final_status,
    finished,
    input_items,
    new_item_id,
    output_as_items,
    output_items,
)
from tokenmill.server.security import request_key
from tokenmill.server.streaming import JobStreamingResponse, finish
from tokenmill.server.tools import ToolPlan

logger = logging.getLogger(__name__)

_ERRORS = error_responses(s404="No such response (for this API key), or unknown model")
_CREATED = streamed(_ERRORS, "events")


def router(state: ServerState) -> APIRouter:
    """The Responses API's routes, with one store for every model the server serves."""
    store = ResponseStore(state.config.response_store_size, state.config.response_store_mb * 1_000_000)
    background: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references to tasks
    api = APIRouter()

    @api.post("/v1/responses", response_model=ResponseObject, responses=_CREATED)
    async def create(body: ResponsesRequest, request: Request) -> Any:
        key = request_key(request.scope)
        async with state_for_model(state, body.model, key) as target:
            return await _create(target, store, background, body, request, key)

    @api.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERRORS)
    async def retrieve(response_id: str, request: Request) -> Any:
        return JSONResponse(store.get(request_key(request.scope), response_id).response.model_dump())

    @api.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_ERRORS)
    async def delete(response_id: str, request: Request) -> Any:
        entry = store.delete(request_key(request.scope), response_id)
        if entry.abort is not None:  # nobody could read what it goes on to write
            entry.cancelled = True
            entry.abort()
        return JSONResponse(DeletedResponse(id=response_id).model_dump())

    @api.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=_ERRORS)
    async def cancel(response_id: str, request: Request) -> Any:
        entry = store.get(request_key(request.scope), response_id)
        if not entry.in_flight or entry.abort is None:
            raise APIError(
                400,
                f"the response {response_id!r} is {entry.response.status}: only one still running can be cancelled.",
                "response_not_cancellable",
            )
        entry.cancelled = True
        entry.abort()
        entry.response = entry.response.model_copy(update={"status": "cancelled"})
        return JSONResponse(entry.response.model_dump())

    @api.get("/v1/responses/{response_id}/input_items", response_model=InputItemList, responses=_ERRORS)
    async def list_input_items(
        response_id: str,
        request: Request,
        order: Literal["asc", "desc"] = "desc",
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: str | None = None,
    ) -> Any:
        entry = store.get(request_key(request.scope), response_id)
        items = entry.items if order == "asc" else entry.items[::-1]
        start = 0
        if after is not None:
            ids = [item.id for item in items]
            if after not in ids:
                raise APIError(400, f"no input item {after!r} in this response.", "invalid_request", "after")
            start = ids.index(after) + 1
        page = [item.model_dump(by_alias=True, exclude_none=True) for item in items[start : start + limit]]
        first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
        more = start + limit < len(items)
        return JSONResponse(InputItemList(data=page, first_id=first, last_id=last, has_more=more).model_dump())

    return api


async def _create(
    state: ServerState,
    store: ResponseStore,
    background: set[asyncio.Task[None]],
    body: ResponsesRequest,
    request: Request,
    key: str,
) -> Any:
    arrival = time.monotonic()
    response_id = new_item_id("resp")
    with state.limiter.charging_refusals(key):
        items = _conversation(store, body, key)
        chat = chat_request(body, items)
        prepared, plan = await prepare_chat(state, chat, key, response_id)
        job = admit(state, key, [prepared], arrival, chat)
    base = ResponseObject(
        id=response_id, created_at=now(), status="in_progress", model=state.model_name, **echoed_settings(body)
    )
    entry = StoredResponse(key, base, items, abort=lambda: close(state, job))

    def done(final: ResponseObject) -> None:
        entry.abort = None
        entry.response = final if not entry.cancelled else final.model_copy(update={"status": "cancelled"})
        store.update(entry)  # its output counts in the store's bound

    if body.store and (body.stream or body.background):  # visible (and cancellable) while it runs
        store.put(entry)
    if body.stream:

        def closed() -> None:  # a client that left before the last event: its response is cancelled
            if entry.abort is not None:
                done(base.model_copy(update={"status": "cancelled"}))

        events = response_events(state, plan, job, base, done, lambda: entry.cancelled)
        # The events end themselves (an `error` event, then response.failed): no framing around them.
        return JobStreamingResponse(state, job, events, lambda frames: frames, closed)
    if body.background:
        entry.response = base.model_copy(update={"status": "queued"})
        task = asyncio.ensure_future(_run(state, chat, plan, job, entry, done))
        background.add(task)
        task.add_done_callback(background.discard)
        return JSONResponse(entry.response.model_dump(), headers=job.admission.headers)
    await finish(state, job, request)
    done(_finished(state, chat, plan, job, base, cancelled=False))
    if body.store:
        store.put(entry)
    return JSONResponse(entry.response.model_dump(), headers=job.admission.headers)


def _conversation(store: ResponseStore, body: ResponsesRequest, key: str) -> list[Item]:
    """The previous response's items and output (404 if it is not stored for this key), then the input."""
    if body.previous_response_id is None:
        return input_items(body)
    previous = store.get(key, body.previous_response_id, "previous_response_id")
    if previous.in_flight:
        raise APIError(
            400,
            f"the previous response {body.previous_response_id!r} is still {previous.response.status}.",
            "previous_response_in_progress",
            "previous_response_id",
        )
    return previous.items + output_as_items(previous.response.output) + input_items(body)


def _finished(
    state: ServerState, chat: ChatCompletionRequest, plan: ToolPlan, job: Job, base: ResponseObject, cancelled: bool
) -> ResponseObject:
    """The response of a job that has run to its end, through the chat route's reply."""
    if not job.outputs:  # aborted (cancelled) before its first step
        return finished(base, final_status("abort", cancelled), [], job)
    choice = chat_response(state, chat, plan, job, base.id).choices[0]
    status = final_status(choice.finish_reason, cancelled)
    return finished(base, status, output_items(choice.message, status), job)


async def _run(
    state: ServerState,
    chat: ChatCompletionRequest,
    plan: ToolPlan,
    job: Job,
    entry: StoredResponse,
    done: Callable[[ResponseObject], None],
) -> None:
    """A background response, run to its end (or its cancellation) and stored."""
    base = entry.response.model_copy(update={"status": "in_progress"})
    if not entry.cancelled:  # else it stays "cancelled" while its job winds down
        entry.response = base
    try:
        await finish(state, job, None)
        done(_finished(state, chat, plan, job, base, entry.cancelled))
    except APIError as exc:
        error = ResponseError(code=exc.code or "server_error", message=exc.message)
        done(base.model_copy(update={"status": "failed", "error": error}))
    except Exception:
        logger.exception("a background response failed")
        error = ResponseError(code="server_error", message=INTERNAL_ERROR_MESSAGE)
        done(base.model_copy(update={"status": "failed", "error": error}))
