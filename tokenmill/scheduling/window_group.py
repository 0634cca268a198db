"""The block accounting of one sliding-window KV layer group (see tokenmill/kv_groups.py): its own pool
and per-request tables, from which the blocks that fell wholly behind the window are freed.

The window rule: a query at position p reads keys j with p - window < j <= p. So once a request has
computed c tokens, its next queries (positions >= c) never read a block that ends at or before
c - window + 1; such a block goes back to the pool (it keeps its prefix-cache hash until evicted) and its
table entry becomes None. The model runner's copy of the table keeps the old id (or NULL_BLOCK_ID where a
prefix hit never held one): the window attention path never reads those entries.

Prefix hits across groups: a hit of L = k * block_size tokens needs group 0's blocks 0..k-1 (the full
layers read all of them) and, in every window group, the blocks holding positions L - window + 1 .. L - 1
(what the queries from L on can reach); the longest k for which all groups have them is the hit."""

from __future__ import annotations

from tokenmill.scheduling.block_pool import Block, BlockHash, BlockPool

# The id the runner gets for a table entry this group never fills (behind the window at a prefix hit):
# any valid block would do, since it is never read.
NULL_BLOCK_ID = 0


class WindowGroup:
    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block | None]] = {}
        self.req_num_freed: dict[str, int] = {}  # leading table entries already None
        self.req_num_indexed: dict[str, int] = {}  # leading blocks already in the prefix-cache index

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` (or later) can read."""
        return max(0, position - self.window + 1) // self.block_size

    def num_hit_blocks(self, hashes: list[BlockHash], max_blocks: int) -> int:
        """The largest k <= max_blocks for which this group holds every block the window reaches back
        from position k * block_size (k = 0 always qualifies)."""
        best, last_miss = 0, -1
        for k in range(1, max_blocks + 1):
            if self.pool.get_cached_block(hashes[k - 1]) is None:
                last_miss = k - 1
            if last_miss < self.first_needed_block(k * self.block_size):
                best = k
        return best

    def fits(
        self, req_id: str, num_computed: int, num_hit_blocks: int, hashes: list[BlockHash], num_blocks: int
    ) -> bool:
        """Whether allocate(...) with the same arguments can succeed. A running request first frees what
        fell behind its window (whatever the answer: it is never read again)."""
        table = self.req_blocks.get(req_id)
        first = self.first_needed_block(num_computed + num_hit_blocks * self.block_size)
        num_evictable_hits = 0
        if num_hit_blocks:
            hits = [self.pool.get_cached_block(h) for h in hashes[first:num_hit_blocks]]
            num_evictable_hits = sum(1 for b in hits if b is not None and b.ref_cnt == 0)
        elif table is not None:
            self._free_behind(req_id, table, first)
        num_new = num_blocks - max(len(table or ()), num_hit_blocks)
        return max(num_new, 0) + num_evictable_hits <= self.pool.num_free_blocks

    def allocate(
        self, req_id: str, num_computed: int, num_hit_blocks: int, hashes: list[BlockHash], num_blocks: int
    ) -> list[int]:
        """Grow the request's table to `num_blocks` entries (after fits(...) said it can): a new request's
        prefix hit of `num_hit_blocks` (see num_hit_blocks) takes the cached blocks its window reaches.
        Returns the new entries' ids."""
        table = self.req_blocks.setdefault(req_id, [])
        ids: list[int] = []
        if num_hit_blocks:
            first = self.first_needed_block(num_computed + num_hit_blocks * self.block_size)
            hits = [self.pool.get_cached_block(h) for h in hashes[first:num_hit_blocks]]
            held = [b for b in hits if b is not None]
            if len(held) != len(hits):
                raise RuntimeError("a window group's prefix hit was evicted between lookup and allocation")
            self.pool.touch(held)
            table.extend([None] * first)
            table.extend(held)
            self.req_num_freed[req_id] = first
            ids = [NULL_BLOCK_ID] * first + [b.block_id for b in held]
        new_blocks = self.pool.get_new_blocks(max(num_blocks - len(table), 0))
        table.extend(new_blocks)
        return ids + [b.block_id for b in new_blocks]

    def _free_behind(self, req_id: str, table: list[Block | None], first_needed: int) -> None:
        start = self.req_num_freed.get(req_id, 0)
        if first_needed <= start:
            return
        behind = [b for b in table[start:first_needed] if b is not None]
        self.pool.free_blocks(behind[::-1])  # the newest last: evicted after the older ones
        table[start:first_needed] = [None] * (first_needed - start)
        self.req_num_freed[req_id] = first_needed

    def cache_full_blocks(self, req_id: str, hashes: list[BlockHash], num_tokens: int) -> None:
        """Index the blocks this step fills (entries behind the window were indexed or never held)."""
        table = self.req_blocks[req_id]
        start = self.req_num_indexed.get(req_id, 0)
        end = min(num_tokens // self.block_size, len(hashes))
        for i in range(start, end):
            block = table[i]
            if block is not None:
                self.pool.cache_block(block, hashes[i])
        if end > start:
            self.req_num_indexed[req_id] = end

    def free(self, req_id: str) -> None:
        """Give back every block the request holds, tail first."""
        table = self.req_blocks.pop(req_id, [])
        self.pool.free_blocks([b for b in reversed(table) if b is not None])
        self.req_num_freed.pop(req_id, None)
        self.req_num_indexed.pop(req_id, None)

    def num_held_blocks(self, req_id: str) -> int:
        return sum(1 for b in self.req_blocks.get(req_id, []) if b is not None)
