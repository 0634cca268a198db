"""OpenAI's Batch API: POST /v1/batches (a JSONL file of requests, checked whole before any runs),
GET /v1/batches/{id}, GET /v1/batches (list), POST /v1/batches/{id}/cancel; with the Files API it
reads from and writes to (files.py). Batches and files are visible only to the key that made them.

    app.include_router(batches.router(state))  # also starts the runner, which resumes unfinished batches"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from tokenmill.server.batch_lines import BATCH_ENDPOINTS, parse_batch_lines
from tokenmill.server.batch_runner import BatchRunner
from tokenmill.server.batch_store import BatchRecord, BatchStore, new_batch_id
from tokenmill.server.batches_protocol import COMPLETION_WINDOWS, Batch, CreateBatchRequest, RequestCounts
from tokenmill.server.config import ServerState
from tokenmill.server.errors import APIError
from tokenmill.server.files import ROUTE_ERRORS, files_router
from tokenmill.server.files_store import FileStore, default_files_dir, new_file_id
from tokenmill.server.security import request_key

MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512  # OpenAI's bounds, in characters


def files_root(state: ServerState) -> Path:
    return Path(state.config.files_dir).expanduser() if state.config.files_dir else default_files_dir()


def router(state: ServerState) -> APIRouter:
    root = files_root(state)
    files, batches = FileStore(root), BatchStore(root)
    runner = BatchRunner(state, files, batches)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runner.resume_all()
        try:
            yield
        finally:
            await runner.stop()

    api = APIRouter(lifespan=lifespan)
    api.include_router(files_router(state, files))

    @api.post("/v1/batches", response_model=Batch, responses=ROUTE_ERRORS)
    async def create(body: CreateBatchRequest, request: Request) -> Any:
        owner = request_key(request.scope)
        _check(body)
        source = files.get(owner, body.input_file_id)
        if source.purpose != "batch":
            raise APIError(400, 'the input file\'s purpose must be "batch".', "invalid_input_file", "input_file_id")
        data = await asyncio.to_thread(files.path(source.id).read_bytes)
        try:
            lines = parse_batch_lines(data, body.endpoint)
        except ValueError as exc:
            raise APIError(400, f"the input file is not a valid batch: {exc}", "invalid_batch_file") from exc
        now = int(time.time())
        batch = Batch(
            id=new_batch_id(),
            endpoint=body.endpoint,
            input_file_id=source.id,
            completion_window=body.completion_window,
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[body.completion_window],
            request_counts=RequestCounts(total=len(lines)),
            metadata=body.metadata,
            model=state.model_name,
        )
        record = BatchRecord(owner, batch, output_id=new_file_id(), error_id=new_file_id())
        batches.save(record)
        runner.start(record)
        return JSONResponse(batch.model_dump())

    @api.get("/v1/batches", responses=ROUTE_ERRORS)
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> Any:
        return JSONResponse(batches.list(request_key(request.scope), limit, after))

    @api.get("/v1/batches/{batch_id}", response_model=Batch, responses=ROUTE_ERRORS)
    async def retrieve(batch_id: str, request: Request) -> Any:
        return JSONResponse(batches.get(request_key(request.scope), batch_id).batch.model_dump())

    @api.post("/v1/batches/{batch_id}/cancel", response_model=Batch, responses=ROUTE_ERRORS)
    async def cancel(batch_id: str, request: Request) -> Any:
        record = batches.get(request_key(request.scope), batch_id)
        if record.batch.status not in ("validating", "in_progress"):
            raise APIError(400, f"the batch is {record.batch.status}: only a running batch can be cancelled.")
        await runner.cancel(record)
        return JSONResponse(record.batch.model_dump())

    return api


def _check(body: CreateBatchRequest) -> None:
    if body.endpoint not in BATCH_ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}.", "invalid_request", "endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        windows = ", ".join(COMPLETION_WINDOWS)
        raise APIError(400, f"completion_window must be {windows}.", "invalid_request", "completion_window")
    for key, value in (body.metadata or {}).items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise APIError(
                400,
                f"metadata keys are at most {MAX_METADATA_KEY} characters, values at most {MAX_METADATA_VALUE}.",
                "invalid_request",
                "metadata",
            )
