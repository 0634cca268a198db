"""The second KV tier's writer: saved blocks are written to the store by a daemon thread, so a step
never waits on the disk. Until written, a block is served from memory; past `max_pending_bytes` of
unwritten blocks a save is dropped (counted), never waited for."""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.kv_tier.store import BlockStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Put:
    block_hash: bytes
    payload: torch.Tensor  # [nbytes] uint8


@dataclass(frozen=True)
class _Delete:
    block_hash: bytes


@dataclass(frozen=True)
class _Flush:
    done: threading.Event


@dataclass(frozen=True)
class _Stop:
    pass


class TierWriter:
    def __init__(self, store: BlockStore, stats: KVTierStats, max_pending_bytes: int) -> None:
        self.store = store
        self.stats = stats
        self.max_pending_bytes = max_pending_bytes
        self._pending: dict[bytes, torch.Tensor] = {}  # saves not yet written
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Put | _Delete | _Flush | _Stop] = queue.SimpleQueue()
        self._errors_logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, block_hash: bytes, payload: torch.Tensor, wait: bool = False) -> bool:
        """Queue a block's save; when the writer is too far behind, wait for it (`wait`, at shutdown) or
        drop the save (False, counted): a step never waits."""
        nbytes = payload.numel()
        if wait and self._pending_bytes + nbytes > self.max_pending_bytes:
            self.flush()
        with self._lock:
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.stats.blocks_dropped += 1
                return False
            old = self._pending.pop(block_hash, None)
            self._pending_bytes += nbytes - (old.numel() if old is not None else 0)
            self._pending[block_hash] = payload
        self._queue.put(_Put(block_hash, payload))
        return True

    def delete(self, block_hash: bytes) -> None:
        """Queue a block's removal (after the saves queued before it); a pending save of it is forgotten."""
        with self._lock:
            old = self._pending.pop(block_hash, None)
            if old is not None:
                self._pending_bytes -= old.numel()
        self._queue.put(_Delete(block_hash))

    def get(self, block_hash: bytes, nbytes: int) -> torch.Tensor | None:
        """A block's payload: from memory while its save is pending, else from the store."""
        with self._lock:
            payload = self._pending.get(block_hash)
        if payload is not None:
            return payload if payload.numel() == nbytes else None
        return self.store.get(block_hash, nbytes)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is done; False on timeout."""
        done = threading.Event()
        self._queue.put(_Flush(done))
        return done.wait(timeout)

    def close(self) -> None:
        """Finish the queued writes, then stop the thread (later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_Stop())
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Stop):
                return
            if isinstance(item, _Flush):
                item.done.set()
            elif isinstance(item, _Delete):
                self._guarded(functools.partial(self.store.delete, item.block_hash))
            else:
                self._write(item.block_hash, item.payload)

    def _write(self, block_hash: bytes, payload: torch.Tensor) -> None:
        with self._lock:
            if self._pending.get(block_hash) is not payload:
                return  # deleted (or saved again) meanwhile
        written = self._guarded(functools.partial(self.store.put, block_hash, payload))
        with self._lock:
            if self._pending.get(block_hash) is payload:
                del self._pending[block_hash]
                self._pending_bytes -= payload.numel()
        if written is None:
            self.stats.blocks_dropped += 1
        else:
            self.stats.blocks_saved += 1
            self.stats.bytes_written += written

    def _guarded(self, action: Callable[[], int | None]) -> int | None:
        """Run a store call on the thread; an error is logged once per kind and never stops the thread."""
        try:
            result = action()
        except Exception as exc:  # noqa: BLE001 - a full disk must not end the writer
            kind = type(exc).__name__
            if kind not in self._errors_logged:
                self._errors_logged.add(kind)
                logger.warning("KV tier store failed (%s: %s); its blocks are dropped, steps go on", kind, exc)
            return None
        return result if isinstance(result, int) else 0
