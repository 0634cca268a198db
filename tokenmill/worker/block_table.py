"""The block tables of the runner's requests, kept from step to step in one host table.

A request owns one row for its whole life; the scheduler's new blocks are written into the row as they
come, so a step's [num_reqs, width] table is one gather of rows, never rebuilt from Python lists (at
256 requests with ~900-token contexts that conversion alone cost about a millisecond per step), and
reaches the device through the step's pinned staging (staging.py)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.worker.staging import Staging


class BlockTables:
    """Rows of block ids by request id; `RunnerRequestState.block_ids` stays the list the rest of the
    runner reads, and this table follows it (the runner updates both in `_update_states`)."""

    def __init__(self, staging: Staging, num_rows: int = 16, width: int = 16) -> None:
        self.staging = staging
        self.device = staging.device
        self.table = np.zeros((num_rows, width), dtype=np.int32)  # [rows, max blocks per request]
        self.lengths = np.zeros(num_rows, dtype=np.int64)  # [rows]: block ids held in each row
        self.rows: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    @classmethod
    def of(cls, device: torch.device, requests: list[tuple[str, list[int]]]) -> BlockTables:
        """A table of these (request id, block ids), for a batch built outside the runner's own."""
        width = max((len(ids) for _, ids in requests), default=1)
        tables = cls(Staging(device), max(len(requests), 1), max(width, 1))
        for req_id, ids in requests:
            tables.add(req_id, ids)
        return tables

    def add(self, req_id: str, block_ids: list[int]) -> None:
        if not self._free:
            self._grow_rows()
        row = self.rows[req_id] = self._free.pop()
        self.table[row] = 0  # zero past its blocks, whatever the row held before
        self.lengths[row] = 0
        self.extend(req_id, block_ids)

    def extend(self, req_id: str, block_ids: list[int]) -> None:
        """Append a request's new block ids to its row."""
        if not block_ids:
            return
        row = self.rows[req_id]
        start = int(self.lengths[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._widen(end)
        self.table[row, start:end] = block_ids
        self.lengths[row] = end

    def remove(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    def host(self, req_ids: list[str]) -> np.ndarray:
        """[len(req_ids), widest row] int32: these requests' tables in this order, zero past each
        row's blocks; a fresh array (fancy indexing copies)."""
        rows = np.fromiter((self.rows[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        width = max(int(self.lengths[rows].max()), 1) if len(rows) else 1
        return self.table[rows, :width]

    def _grow_rows(self) -> None:
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _widen(self, width: int) -> None:
        wider = np.zeros((self.table.shape[0], max(width, 2 * self.table.shape[1])), dtype=np.int32)
        wider[:, : self.table.shape[1]] = self.table
        self.table = wider
