"""Uploaded files and batch outputs on disk: one file per id under the files folder, and a JSON index
(id -> owner and OpenAI's File object) rewritten atomically on every change. A file is visible only to
the API key that made it: any other key gets the same 404 as for an id that does not exist."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from tokenmill.server.errors import APIError

INDEX = "files.json"
MAX_LIST_LIMIT = 10_000  # OpenAI's bound on GET /v1/files?limit=


def default_files_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "tokenmill" / "files"


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileObject(BaseModel):
    """OpenAI's File object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileStore:
    """The files folder: contents at `<dir>/<id>`, their records in `<dir>/files.json`. Only the event
    loop calls it (the index is read once and kept), so no lock is needed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._records: dict[str, tuple[str, FileObject]] = {}  # id -> (owner key, record)
        index = root / INDEX
        if index.is_file():
            for entry in json.loads(index.read_text()):
                self._records[entry["file"]["id"]] = (entry["owner"], FileObject(**entry["file"]))

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    def add(self, owner: str, file_id: str, filename: str, purpose: str) -> FileObject:
        """Register the content already written at `path(file_id)`."""
        size = self.path(file_id).stat().st_size
        record = FileObject(id=file_id, bytes=size, created_at=int(time.time()), filename=filename, purpose=purpose)
        self._records[file_id] = (owner, record)
        self._save()
        return record

    def get(self, owner: str, file_id: str) -> FileObject:
        entry = self._records.get(file_id)
        if entry is None or entry[0] != owner:
            raise APIError(404, f"no file with id {file_id!r}.", "file_not_found", "file_id")
        return entry[1]

    def list(self, owner: str, purpose: str | None, limit: int, after: str | None, order: str) -> dict[str, Any]:
        """A page of the owner's files, newest first unless `order` is "asc"; `after` is the last id seen."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise APIError(400, f"limit must be between 1 and {MAX_LIST_LIMIT}.", "invalid_request", "limit")
        if order not in ("asc", "desc"):
            raise APIError(400, 'order must be "asc" or "desc".', "invalid_request", "order")
        mine = [r for o, r in self._records.values() if o == owner and (purpose is None or r.purpose == purpose)]
        mine.sort(key=lambda r: (r.created_at, r.id), reverse=order == "desc")
        return list_page(mine, limit, after)

    def delete(self, owner: str, file_id: str) -> None:
        self.get(owner, file_id)
        del self._records[file_id]
        self._save()
        self.path(file_id).unlink(missing_ok=True)

    def _save(self) -> None:
        entries = [{"owner": owner, "file": record.model_dump()} for owner, record in self._records.values()]
        write_atomically(self.root / INDEX, json.dumps(entries))


def write_atomically(path: Path, text: str) -> None:
    """A reader (or a restart after a crash) sees the old content or the new, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _Listed(Protocol):
    id: str

    def model_dump(self) -> dict[str, Any]: ...


def list_page(items: Sequence[_Listed], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's list object for `items` (already in order): `limit` of them after the id `after`."""
    ids = [item.id for item in items]
    start = ids.index(after) + 1 if after in ids else 0
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": [item.model_dump() for item in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": start + limit < len(items),
    }
