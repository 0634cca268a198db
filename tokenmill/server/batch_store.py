"""Batches on disk: one JSON file per batch (`<files dir>/batches/<id>.json`: its owner, its Batch
object, and where its output lines go), rewritten atomically on every change, so a restarted server
knows every batch and where each unfinished one stopped."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.server.batches_protocol import Batch
from tokenmill.server.errors import APIError
from tokenmill.server.files_store import list_page, write_atomically

MAX_LIST_LIMIT = 100  # OpenAI's bound on GET /v1/batches?limit=


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


@dataclass
class BatchRecord:
    owner: str  # the API key's name: other keys get 404
    batch: Batch
    # Output lines are written here as they finish, under ids the Files API shows once the batch ends.
    output_id: str
    error_id: str


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.folder = root / "batches"
        self._records: dict[str, BatchRecord] = {}
        if self.folder.is_dir():
            for path in sorted(self.folder.glob("*.json")):
                raw = json.loads(path.read_text())
                record = BatchRecord(raw["owner"], Batch(**raw["batch"]), raw["output_id"], raw["error_id"])
                self._records[record.batch.id] = record

    def records(self) -> list[BatchRecord]:
        return list(self._records.values())

    def save(self, record: BatchRecord) -> None:
        self._records[record.batch.id] = record
        raw = {
            "owner": record.owner,
            "batch": record.batch.model_dump(),
            "output_id": record.output_id,
            "error_id": record.error_id,
        }
        write_atomically(self.folder / f"{record.batch.id}.json", json.dumps(raw))

    def get(self, owner: str, batch_id: str) -> BatchRecord:
        record = self._records.get(batch_id)
        if record is None or record.owner != owner:
            raise APIError(404, f"no batch with id {batch_id!r}.", "batch_not_found", "batch_id")
        return record

    def list(self, owner: str, limit: int, after: str | None) -> dict[str, Any]:
        """A page of the owner's batches, newest first; `after` is the last id of the previous page."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise APIError(400, f"limit must be between 1 and {MAX_LIST_LIMIT}.", "invalid_request", "limit")
        mine = sorted(
            (r.batch for r in self._records.values() if r.owner == owner),
            key=lambda b: (b.created_at, b.id),
            reverse=True,
        )
        return list_page(mine, limit, after)
