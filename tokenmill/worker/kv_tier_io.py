"""The runner's side of the second KV tier (tokenmill/kv_tier): copies a pool block's KV, every layer's,
out to the tier's writer and back from the store into a free pool block.

A block's payload is one flat byte string: for each layer in cache order, its [2, block_size, Hkv, width]
slice (keys then values) as the cache stores it, so a load restores the bytes a save took, bit for bit."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from tokenmill.config import EngineConfig
from tokenmill.kv_tier.folder import tier_folder
from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.kv_tier.store import BlockStore, FileBlockStore, HostBlockStore
from tokenmill.kv_tier.writer import TierWriter
from tokenmill.outputs import SchedulerOutput
from tokenmill.worker import packed_cache

FORMAT_VERSION = 1  # of the payload layout above; part of the tier folder's identity
# Saves waiting for the writer thread, at most (beyond it a save is dropped, never waited for).
MAX_PENDING_BYTES = 256 * 2**20


class KVTierIO:
    def __init__(self, kv_caches: list[torch.Tensor], store: BlockStore, stats: KVTierStats) -> None:
        self.kv_caches = kv_caches
        self.stats = stats
        # Bytes of each layer's slice of one block: [2, block_size, Hkv, width].
        self.layer_nbytes = [cache[:, 0].numel() * cache.element_size() for cache in kv_caches]
        self.block_nbytes = sum(self.layer_nbytes)
        self.store = store
        self.writer = TierWriter(store, stats, max(MAX_PENDING_BYTES, 4 * self.block_nbytes))
        self._fetched: dict[bytes, torch.Tensor] = {}  # read for this step's loads: hash -> payload

    def fetch(self, hashes: list[bytes]) -> int:
        """Read and check the tier blocks of `hashes`, in order, for this step's loads; how many leading
        ones are good (the scheduler's TierScheduler.fetch: it runs on the scheduler's side of the step)."""
        start = time.perf_counter()
        good = 0
        for block_hash in hashes:
            payload = self.writer.get(block_hash, self.block_nbytes)
            if payload is None:
                break
            self._fetched[block_hash] = payload
            good += 1
        self.stats.bytes_read += good * self.block_nbytes
        self.stats.load_seconds += time.perf_counter() - start
        self.stats.loads += 1
        return good

    def probe(self, hashes: list[bytes]) -> int:
        """How many leading `hashes` the store holds (other engines' saves; a load still checks each)."""
        num = 0
        while num < len(hashes) and self.store.contains(hashes[num]):
            num += 1
        return num

    def save_now(self, saves: Sequence[tuple[int, bytes]], deletes: Sequence[bytes]) -> None:
        """Write `saves` and apply `deletes` before returning (a prefill engine's prompt blocks, which a
        decode engine reads next)."""
        for block_id, block_hash in saves:
            self.writer.submit(block_hash, self._gather(block_id), wait=True)
        for block_hash in deletes:
            self.writer.delete(block_hash)
        self.writer.flush()

    def transfer(self, sched: SchedulerOutput) -> None:
        """The step's saves (before its forward overwrites the evicted blocks), deletes, then loads of the
        blocks fetched while it was scheduled."""
        for block_id, block_hash in sched.kv_saves:
            self.writer.submit(block_hash, self._gather(block_id))
        for block_hash in sched.kv_deletes:
            self.writer.delete(block_hash)
        start = time.perf_counter()
        for block_id, block_hash in sched.kv_loads:
            self._scatter(block_id, self._fetched.pop(block_hash))
        self._fetched.clear()  # fetched for a step that never ran
        self.stats.load_seconds += time.perf_counter() - start

    def _gather(self, block_id: int) -> torch.Tensor:
        payload = torch.empty(self.block_nbytes, dtype=torch.uint8)  # [block_nbytes]
        offset = 0
        for cache, nbytes in zip(self.kv_caches, self.layer_nbytes):
            src = cache[:, block_id]  # [2, block_size, Hkv, width]
            payload[offset : offset + nbytes].view(src.dtype).view(src.shape).copy_(src)
            offset += nbytes
        return payload

    def _scatter(self, block_id: int, payload: torch.Tensor) -> None:
        offset = 0
        for cache, nbytes in zip(self.kv_caches, self.layer_nbytes):
            dst = cache[:, block_id]  # [2, block_size, Hkv, width]
            dst.copy_(payload[offset : offset + nbytes].view(dst.dtype).view(dst.shape))
            offset += nbytes

    def close(self, saves: Sequence[tuple[int, bytes]] = (), deletes: Sequence[bytes] = ()) -> None:
        """Write `saves` (waiting for the writer where a step would drop them), apply `deletes`, finish
        every write under way (a restart then finds them), and stop the writer."""
        for block_id, block_hash in saves:
            self.writer.submit(block_hash, self._gather(block_id), wait=True)
        for block_hash in deletes:
            self.writer.delete(block_hash)
        self.writer.close()


def open_kv_tier(
    config: EngineConfig, folder: Path | None, kv_caches: list[torch.Tensor], stats: KVTierStats
) -> KVTierIO:
    """The tier's store for this model's KV layout: files under --kv-offloading-path on CPU (they outlive
    the process), host memory behind a GPU."""
    if kv_caches[0].device.type == "cpu":
        store: BlockStore = FileBlockStore(
            tier_folder(config.cache.kv_offloading_path, _identity(config, folder, kv_caches))
        )
    else:
        store = HostBlockStore()
    return KVTierIO(kv_caches, store, stats)


def _identity(config: EngineConfig, folder: Path | None, kv_caches: list[torch.Tensor]) -> Mapping[str, object]:
    """What makes stored KV bytes valid here: the weights and how they were loaded (the packed-weight
    cache's key), the cache's dtype and block layout, and the payload format."""
    return {
        "weights": packed_cache.cache_file(config.model, folder).stem,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "block_size": config.cache.block_size,
        "layers": [[str(c.dtype), *c.shape[2:]] for c in kv_caches],
        "format": FORMAT_VERSION,
    }
