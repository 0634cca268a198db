"""The second KV tier's pieces (tokenmill/kv_tier): the LRU index, the file and host stores with their
integrity checks, the writer thread that never makes a step wait, and the folder keyed by identity."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from tokenmill.kv_tier.folder import tier_folder
from tokenmill.kv_tier.index import TierIndex
from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.kv_tier.store import FileBlockStore, HostBlockStore
from tokenmill.kv_tier.writer import TierWriter
from tokenmill.outputs import SchedulerOutput
from tokenmill.worker.kv_tier_io import KVTierIO

H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))
NBYTES = 4096


def payload(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ index
def test_index_drops_the_least_recently_used_and_match_stops_at_the_first_miss() -> None:
    index = TierIndex(2)
    assert index.add(H1) == [] and index.add(H2) == []
    assert index.match([H1, H3, H2]) == 1  # H1 now the most recent
    assert index.add(H3) == [H2]
    assert H1 in index and H2 not in index and len(index) == 2


def test_index_rebuilt_over_capacity_hands_back_the_oldest() -> None:
    index, dropped = TierIndex.of(2, [H1, H2, H3])
    assert dropped == [H1] and index.match([H2, H3]) == 2


# ------------------------------------------------------------------------------------------ stores
def test_file_store_round_trip_survives_a_new_store_on_the_folder(tmp_path: Path) -> None:
    store = FileBlockStore(tmp_path)
    store.put(H1, payload(1))
    time.sleep(0.01)
    store.put(H2, payload(2))
    again = FileBlockStore(tmp_path)
    assert again.hashes() == [H1, H2]  # oldest first
    got = again.get(H1, NBYTES)
    assert got is not None and torch.equal(got, payload(1))
    assert again.get(H3, NBYTES) is None
    assert not list(tmp_path.rglob("*.tmp*"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "renamed", "size"])
def test_a_damaged_block_file_is_a_miss_with_a_warning_and_is_deleted(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileBlockStore(tmp_path)
    store.put(H1, payload(1))
    path = next(tmp_path.rglob("*.kvb"))
    data = path.read_bytes()
    nbytes = NBYTES
    if damage == "flip":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif damage == "truncate":
        path.write_bytes(data[:-100])
    elif damage == "renamed":  # another block's file under this hash's name
        store.put(H2, payload(2))
        other = next(p for p in tmp_path.rglob("*.kvb") if p != path)
        other.replace(path)
    else:
        nbytes = NBYTES * 2  # the layout changed: a block of another size
    with caplog.at_level(logging.WARNING):
        assert store.get(H1, nbytes) is None
    assert any("unusable" in r.getMessage() for r in caplog.records)
    assert not path.exists()


def test_host_store_round_trip_and_size_check() -> None:
    store = HostBlockStore()
    store.put(H1, payload(1))
    got = store.get(H1, NBYTES)
    assert got is not None and torch.equal(got, payload(1))
    assert store.get(H1, NBYTES + 1) is None and store.hashes() == []


# ------------------------------------------------------------------------------------------ writer
class SlowStore(HostBlockStore):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def put(self, block_hash: bytes, data: torch.Tensor) -> int:
        time.sleep(self.delay)
        return super().put(block_hash, data)


def test_submit_never_waits_for_a_slow_store_and_pending_blocks_are_served() -> None:
    stats = KVTierStats()
    writer = TierWriter(SlowStore(0.5), stats, max_pending_bytes=10 * NBYTES)
    start = time.perf_counter()
    assert writer.submit(H1, payload(1)) and writer.submit(H2, payload(2))
    assert time.perf_counter() - start < 0.05
    got = writer.get(H2, NBYTES)  # still pending: from memory
    assert got is not None and torch.equal(got, payload(2))
    assert writer.flush(timeout=5) and stats.blocks_saved == 2 and stats.bytes_written == 2 * NBYTES
    writer.close()
    writer.close()  # idempotent


def test_a_writer_too_far_behind_drops_saves_and_counts_them() -> None:
    stats = KVTierStats()
    writer = TierWriter(SlowStore(0.3), stats, max_pending_bytes=2 * NBYTES)
    results = [writer.submit(h, payload(i)) for i, h in enumerate([H1, H2, H3])]
    assert results == [True, True, False] and stats.blocks_dropped == 1
    writer.close()
    assert stats.blocks_saved == 2


def test_a_delete_after_a_submit_wins() -> None:
    writer = TierWriter(SlowStore(0.1), KVTierStats(), max_pending_bytes=10 * NBYTES)
    writer.submit(H1, payload(1))
    writer.delete(H1)
    assert writer.get(H1, NBYTES) is None
    writer.flush(timeout=5)
    assert writer.get(H1, NBYTES) is None
    writer.close()


def test_a_failing_store_never_stops_the_writer(caplog: pytest.LogCaptureFixture) -> None:
    class Full(HostBlockStore):
        def put(self, block_hash: bytes, data: torch.Tensor) -> int:
            raise OSError(28, "No space left on device")

    stats = KVTierStats()
    writer = TierWriter(Full(), stats, max_pending_bytes=10 * NBYTES)
    with caplog.at_level(logging.WARNING):
        writer.submit(H1, payload(1))
        writer.submit(H2, payload(2))
        assert writer.flush(timeout=5)
    assert stats.blocks_dropped == 2 and stats.blocks_saved == 0
    assert sum("No space" in r.getMessage() for r in caplog.records) == 1  # once per kind
    assert any(t.name == "kv-tier-writer" for t in threading.enumerate())
    writer.close()


# ------------------------------------------------------------------------------------------ folder
def test_each_identity_gets_its_own_folder(tmp_path: Path) -> None:
    a = tier_folder(str(tmp_path), {"weights": "a", "block_size": 16})
    b = tier_folder(str(tmp_path), {"weights": "b", "block_size": 16})
    assert a != b and a == tier_folder(str(tmp_path), {"block_size": 16, "weights": "a"})
    assert (a / "identity.json").is_file()


def test_a_step_saving_to_a_slow_tier_does_not_wait_and_loads_back_the_same_bytes() -> None:
    caches = [torch.randn(2, 6, 16, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    stats = KVTierStats()
    io = KVTierIO(caches, SlowStore(0.5), stats)
    start = time.perf_counter()
    io.transfer(SchedulerOutput([], [], {}, 0, kv_saves=[(1, H1), (4, H2)]))
    assert time.perf_counter() - start < 0.1
    saved = [c[:, 1].clone() for c in caches]
    for cache in caches:
        cache[:, 1].zero_()
    assert io.fetch([H1, H3, H2]) == 1  # H3 was never saved: the prefix ends there
    io.transfer(SchedulerOutput([], [], {}, 0, kv_loads=[(1, H1)]))
    assert all(torch.equal(c[:, 1], s) for c, s in zip(caches, saved))
    io.close()
    assert stats.blocks_saved == 2 and stats.bytes_read == io.block_nbytes
