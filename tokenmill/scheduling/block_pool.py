"""The pool of KV-cache blocks: reference counts, an LRU free queue, and the prefix-cache index."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

BlockHash = bytes

# The root of every hash chain; changing it invalidates nothing persistent (the cache lives in memory).
_ROOT_HASH: BlockHash = hashlib.sha256(b"tokenmill-kv-root").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """sha256(parent hash, token ids, extra keys): equal keys mean equal prefixes, across requests."""
    h = hashlib.sha256(parent if parent is not None else _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and its KV written


class BlockPool:
    """Owns every block. Free blocks sit in LRU order (oldest first) and keep their hash, so a
    later request with the same prefix can take them back until they are evicted for reuse."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self._num_cached_free = 0  # free blocks still holding a prefix (kept up to date: read every step)
        # Told of each cached block taken for reuse, while its KV is still there (the second KV tier saves it).
        self.on_evict: Callable[[Block, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reusable until evicted)."""
        return self._num_cached_free

    @property
    def usage(self) -> float:
        """Share of blocks held by live requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_blocks(self) -> list[tuple[BlockHash, Block]]:
        """Every indexed block (hash, block), in the order they were indexed."""
        return list(self._cached.items())

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._num_cached_free -= block.block_hash is not None
            self._evict(block, reused=True)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found in the prefix cache (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                self._num_cached_free -= block.block_hash is not None
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[Block]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue's tail (evicted last)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                self._num_cached_free += block.block_hash is not None

    def cache_block(self, block: Block, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # If an identical block is already indexed keep that one; this block still holds valid KV.
        self._cached.setdefault(block_hash, block)

    def forget(self, block: Block) -> None:
        """Drop a block from the prefix-cache index (its KV is not what its hash says)."""
        if block.block_hash is not None and block.ref_cnt == 0:
            self._num_cached_free -= 1
        self._evict(block)

    def _evict(self, block: Block, reused: bool = False) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if reused and self.on_evict is not None:
                    self.on_evict(block, block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)
        self._num_cached_free = 0

    def check_integrity(self) -> None:
        """Invariants for tests: free blocks have ref 0 and every other block has ref > 0."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            if in_free != (block.ref_cnt == 0) or block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id}: ref_cnt={block.ref_cnt}, free={in_free}")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cache index points at block {block.block_id} with another hash")
        cached_free = sum(b.block_hash is not None for b in self._free.values())
        if cached_free != self._num_cached_free:
            raise AssertionError(f"{cached_free} free blocks hold a prefix, counted {self._num_cached_free}")
