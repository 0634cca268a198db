"""The scheduler's side of the second KV tier (tokenmill/kv_tier): which evicted blocks to save, and which
tier blocks a waiting request loads.

On admission, a request whose prefix continues in the tier past the pool's hits has those blocks read and
checked at once (`fetch`, the runner's: the tier needs the runner in the engine core's process), written
into free pool blocks at the start of this step (SchedulerOutput.kv_loads, before the forward) and indexed
in the pool's prefix cache, so the request's lookup finds them like any other pool hit and it runs in this
very step. A block that fails its checks ends the loaded prefix there (a miss, dropped from the index). A
request looks in the tier once: a prefix loaded and evicted again before it ran is recomputed, not loaded
in a loop."""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.kv_tier.index import TierIndex
from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.scheduling.block_pool import Block, BlockHash
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.request import Request

# Reads and checks the tier blocks of these hashes, in order, keeping them for this step's loads; returns
# how many leading ones are good (the first bad one ends the prefix).
Fetch = Callable[[list[bytes]], int]
# How many leading hashes of these the tier's store holds, written there by other engines (prefill/decode
# disaggregation: a decode engine's index never saw them).
Probe = Callable[[list[bytes]], int]


class TierScheduler:
    def __init__(
        self, kv_cache: KVCacheManager, index: TierIndex, stats: KVTierStats, fetch: Fetch, probe: Probe | None = None
    ) -> None:
        self.kv_cache = kv_cache
        self.index = index
        self.stats = stats
        self.fetch = fetch
        self.probe = probe
        stats.capacity_blocks = index.capacity_blocks
        stats.num_blocks = len(index)
        # This step's transfers, handed out by take_step().
        self._saves: dict[BlockHash, int] = {}  # hash -> pool block id, in eviction order
        self._deletes: dict[BlockHash, None] = {}
        self._loads: list[tuple[Block, BlockHash]] = []
        kv_cache.pool.on_evict = self._save

    def _save(self, block: Block, block_hash: BlockHash) -> None:
        """A cached block is taken for reuse: save it unless the tier holds its hash already."""
        if block_hash in self.index:
            return
        for dropped in self.index.add(block_hash):
            if self._saves.pop(dropped, None) is None:  # saved in an earlier step: delete it from the store
                self._deletes[dropped] = None
        self._deletes.pop(block_hash, None)  # the save rewrites it
        self._saves[block_hash] = block.block_id

    def save_pool(self) -> tuple[list[tuple[int, bytes]], list[bytes]]:
        """(saves, deletes) that copy every prefix the pool holds into the tier (at shutdown, into a tier
        that outlives the process: a restart then finds the hottest prefixes too)."""
        for block_hash, block in self.kv_cache.pool.cached_blocks():
            self._save(block, block_hash)
        saves, _, deletes = self.take_step()
        return saves, deletes

    def load(self, request: Request, pool_hits: list[Block]) -> bool:
        """Load the request's blocks found in the tier after its pool hits into free pool blocks, indexed
        as cached; True when any were (its prefix-cache lookup then finds them)."""
        if request.kv_tier_checked or not self.kv_cache.can_hit(request):
            return False
        request.kv_tier_checked = True
        hashes = self.kv_cache.block_hashes(request)[len(pool_hits) : self.kv_cache.max_hit_blocks(request)]
        pool = self.kv_cache.pool
        num = self.index.match(hashes)
        if self.probe is not None and num < len(hashes):  # saved by a prefill engine since
            found = self.probe(hashes[num:])
            for block_hash in hashes[num : num + found]:
                self.index.add(block_hash)  # what this drops is other engines' to delete, not ours
            num += found
        if num == 0:
            return False
        pool.touch(pool_hits)  # taking free blocks must not evict the hits the loads extend
        num = min(num, pool.num_free_blocks)
        # Taking free blocks may evict cached ones: they are saved first (the runner saves, then loads).
        blocks = pool.get_new_blocks(num)
        good = self.fetch(hashes[:num])
        if good < num:
            self.index.discard(hashes[good])
            self.stats.load_failures += 1
        for block, block_hash in zip(blocks[:good], hashes):
            pool.cache_block(block, block_hash)
            self._loads.append((block, block_hash))
        self.stats.blocks_loaded += good
        self.stats.hit_tokens += good * self.kv_cache.block_size
        pool.free_blocks([*reversed(blocks), *pool_hits])  # loaded blocks to the tail, the prefix's head last
        return good > 0

    def take_step(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], list[bytes]]:
        """(saves, loads, deletes) for this step's SchedulerOutput."""
        saves = [(block_id, h) for h, block_id in self._saves.items()]
        loads = [(block.block_id, h) for block, h in self._loads]
        deletes = list(self._deletes)
        self._saves, self._deletes, self._loads = {}, {}, []
        self.stats.num_blocks = len(self.index)
        return saves, loads, deletes

    def step_failed(self, loads: list[tuple[int, bytes]]) -> None:
        """The step that was to write `loads` into the pool raised: those blocks hold no such KV."""
        pool = self.kv_cache.pool
        for block_id, _ in loads:
            pool.forget(pool.blocks[block_id])
