"""The scheduler's side of the second KV tier (tokenmill/kv_tier): which evicted blocks to save, which
tier blocks a waiting request can load, and what a step's loads came to.

A waiting request whose prefix continues in the tier past the pool's hits gets free pool blocks, and the
step's SchedulerOutput names the (block, hash) pairs to load; the request sits that step out. After the
step each loaded block is indexed in the pool's prefix cache and freed (to the free queue's tail: evicted
last), so the request's next lookup finds it like any other pool hit; a failed load is a miss, dropped
from the index. A request looks in the tier once: a prefix loaded and evicted again before it ran is
recomputed rather than loaded in a loop."""

from __future__ import annotations

from tokenmill.kv_tier.index import TierIndex
from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.scheduling.block_pool import Block, BlockHash
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.request import Request


class TierScheduler:
    def __init__(self, kv_cache: KVCacheManager, index: TierIndex, stats: KVTierStats) -> None:
        self.kv_cache = kv_cache
        self.index = index
        self.stats = stats
        stats.capacity_blocks = index.capacity_blocks
        stats.num_blocks = len(index)
        # This step's transfers, handed out by take_step(); loads are kept until the step's result.
        self._saves: dict[BlockHash, int] = {}  # hash -> pool block id, in eviction order
        self._deletes: dict[BlockHash, None] = {}
        self._loads: list[tuple[Block, BlockHash]] = []
        self._held: list[Block] = []  # pool hits of the loading requests, held so the loads cannot evict them
        kv_cache.pool.on_evict = self._on_evict

    def _on_evict(self, block: Block, block_hash: BlockHash) -> None:
        """A cached block is taken for reuse: save it unless the tier holds its hash already."""
        self._save(block, block_hash)

    def save_pool(self) -> tuple[list[tuple[int, bytes]], list[bytes]]:
        """(saves, deletes) that copy every prefix the pool holds into the tier (at shutdown, into a tier
        that outlives the process: a restart then finds the hottest prefixes too)."""
        for block_hash, block in self.kv_cache.pool.cached_blocks():
            self._save(block, block_hash)
        saves, _, deletes = self.take_step()
        return saves, deletes

    def _save(self, block: Block, block_hash: BlockHash) -> None:
        if block_hash in self.index:
            return
        for dropped in self.index.add(block_hash):
            if self._saves.pop(dropped, None) is None:  # saved in an earlier step: delete it from the store
                self._deletes[dropped] = None
        self._deletes.pop(block_hash, None)  # the save rewrites it
        self._saves[block_hash] = block.block_id
        self.stats.num_blocks = len(self.index)

    def start_loads(self, request: Request, pool_hits: list[Block]) -> bool:
        """Load the request's blocks found in the tier after its pool hits into free pool blocks this
        step; True when loads were started (the request then waits for the next step)."""
        if request.kv_tier_checked or not self.kv_cache.can_hit(request):
            return False
        request.kv_tier_checked = True
        hashes = self.kv_cache.block_hashes(request)[len(pool_hits) : self.kv_cache.max_hit_blocks(request)]
        pool = self.kv_cache.pool
        num_matched = self.index.match(hashes)
        if num_matched == 0:
            return False
        pool.touch(pool_hits)
        self._held.extend(pool_hits)
        num = min(num_matched, pool.num_free_blocks)
        # Taking free blocks may evict cached ones: _on_evict saves them first (the runner saves, then loads).
        self._loads.extend(zip(pool.get_new_blocks(num), hashes[:num]))
        return True

    @property
    def loading(self) -> list[bytes]:
        """Hashes this step loads."""
        return [h for _, h in self._loads]

    def take_step(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], list[bytes]]:
        """(saves, loads, deletes) for this step's SchedulerOutput."""
        saves = [(block_id, h) for h, block_id in self._saves.items()]
        loads = [(block.block_id, h) for block, h in self._loads]
        deletes = list(self._deletes)
        self._saves, self._deletes = {}, {}
        return saves, loads, deletes

    def finish_loads(self, failed: list[bytes]) -> None:
        """After the step (failed: the hashes whose loads failed; every one when the step failed): index
        the step's loaded blocks in the pool's prefix cache and free them; failures are misses."""
        bad = set(failed)
        pool = self.kv_cache.pool
        for block, block_hash in self._loads:
            if block_hash in bad:
                self.index.discard(block_hash)
                self.stats.load_failures += 1
            else:
                pool.cache_block(block, block_hash)
                self.stats.blocks_loaded += 1
                self.stats.hit_tokens += self.kv_cache.block_size
        pool.free_blocks([block for block, _ in reversed(self._loads)])  # the prefix's head evicted last
        pool.free_blocks(self._held)
        self._loads, self._held = [], []
        self.stats.num_blocks = len(self.index)
