"""OpenAI's Files API, for the Batch API's input and output: POST /v1/files (multipart: file + purpose),
GET /v1/files (the key's own), GET and DELETE /v1/files/{id}, GET /v1/files/{id}/content."""

from __future__ import annotations

import asyncio
import shutil
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import FileResponse, JSONResponse

from tokenmill.server.config import ServerConfig, ServerState
from tokenmill.server.errors import APIError
from tokenmill.server.files_store import FileObject, FileStore, new_file_id
from tokenmill.server.openapi_errors import error_responses
from tokenmill.server.security import request_key

UPLOAD_PATH = "/v1/files"
# Room for the multipart envelope (boundaries, part headers, the purpose field) around a file at the cap.
UPLOAD_ENVELOPE_BYTES = 64 << 10
UPLOAD_PURPOSES = ("batch",)
# The error answers of the Files and Batch routes, for their OpenAPI schema.
ROUTE_ERRORS = error_responses(s404="No such file or batch (or not this key's)", s413="File too large")


def upload_body_limit(state: ServerState) -> int:
    """The body limit of POST /v1/files: a file at --max-file-bytes, with its envelope, and no more."""
    return upload_bytes_limit(state.config)


def upload_bytes_limit(config: ServerConfig) -> int:
    """The same, from the settings alone (the fleet's ingress has no server state)."""
    return config.max_file_bytes + UPLOAD_ENVELOPE_BYTES


def files_router(state: ServerState, store: FileStore) -> APIRouter:
    router = APIRouter()

    @router.post(UPLOAD_PATH, response_model=FileObject, responses=ROUTE_ERRORS)
    async def upload(request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> Any:
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(
                400,
                f"purpose {purpose!r} is not supported: this server keeps files for the Batch API only "
                '(purpose "batch").',
                "unsupported_purpose",
                "purpose",
            )
        cap = state.config.max_file_bytes
        if file.size is not None and file.size > cap:
            raise APIError(413, f"the file is larger than this server's limit of {cap} bytes.", "file_too_large")
        file_id = new_file_id()
        await asyncio.to_thread(_copy, file.file, store, file_id)
        record = store.add(request_key(request.scope), file_id, file.filename or "upload.jsonl", purpose)
        return JSONResponse(record.model_dump())

    @router.get(UPLOAD_PATH, responses=ROUTE_ERRORS)
    async def list_files(
        request: Request, purpose: str | None = None, limit: int = 10_000, after: str | None = None, order: str = "desc"
    ) -> Any:
        return JSONResponse(store.list(request_key(request.scope), purpose, limit, after, order))

    @router.get(UPLOAD_PATH + "/{file_id}", response_model=FileObject, responses=ROUTE_ERRORS)
    async def retrieve(file_id: str, request: Request) -> Any:
        return JSONResponse(store.get(request_key(request.scope), file_id).model_dump())

    @router.delete(UPLOAD_PATH + "/{file_id}", responses=ROUTE_ERRORS)
    async def delete(file_id: str, request: Request) -> Any:
        store.delete(request_key(request.scope), file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @router.get(UPLOAD_PATH + "/{file_id}/content", response_class=FileResponse, responses=ROUTE_ERRORS)
    async def content(file_id: str, request: Request) -> Any:
        record = store.get(request_key(request.scope), file_id)
        return FileResponse(store.path(file_id), media_type="application/octet-stream", filename=record.filename)

    return router


def _copy(source: BinaryIO, store: FileStore, file_id: str) -> None:
    store.root.mkdir(parents=True, exist_ok=True)
    with store.path(file_id).open("wb") as out:
        shutil.copyfileobj(source, out)
