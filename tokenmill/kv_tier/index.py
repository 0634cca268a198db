"""Which block hashes the second KV tier holds, least recently used first: the scheduler's view of the
tier (the store may lag behind it: a load checks every block, so a stale entry is a miss)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class TierIndex:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the KV tier needs room for at least one block, got {capacity_blocks}.")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` the tier holds (up to the first miss); they become the most recent."""
        num = 0
        for block_hash in hashes:
            if block_hash not in self._lru:
                break
            self._lru.move_to_end(block_hash)
            num += 1
        return num

    def add(self, block_hash: bytes) -> list[bytes]:
        """Insert (or refresh) as the most recent; the hashes dropped to stay within capacity, oldest first."""
        self._lru[block_hash] = None
        self._lru.move_to_end(block_hash)
        dropped = []
        while len(self._lru) > self.capacity_blocks:
            dropped.append(self._lru.popitem(last=False)[0])
        return dropped

    def discard(self, block_hash: bytes) -> None:
        self._lru.pop(block_hash, None)

    def clear(self) -> None:
        self._lru.clear()

    @classmethod
    def of(cls, capacity_blocks: int, hashes_oldest_first: Iterable[bytes]) -> tuple[TierIndex, list[bytes]]:
        """An index rebuilt from a store's blocks (after a restart); and those beyond the capacity, oldest
        first, for the caller to delete."""
        index = cls(capacity_blocks)
        dropped = []
        for block_hash in hashes_oldest_first:
            dropped.extend(index.add(block_hash))
        return index, dropped
