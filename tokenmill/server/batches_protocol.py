"""The Batch API's wire models: the create request and OpenAI's Batch object."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tokenmill.server.strict import StrictModel

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
# Statuses a batch leaves by itself: a restarted server picks such batches up again.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's only window


class CreateBatchRequest(StrictModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    # OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
