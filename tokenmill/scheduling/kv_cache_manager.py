"""Maps requests to KV-cache blocks: prefix-cache lookups, allocation for each step, freeing.

The blocks of group 0 (the full-attention layers: every layer of most models) live here; a model with
sliding-window layers adds a WindowGroup per window size (tokenmill/kv_groups.py, window_group.py),
allocated in step with group 0: a step gets its blocks in every group or in none."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.scheduling.block_pool import Block, BlockHash, BlockPool, hash_block_tokens
from tokenmill.scheduling.request import Request
from tokenmill.scheduling.window_group import WindowGroup


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def first_block_extra_key(request: Request) -> bytes:
    """The first block's extra hash key: the request's cache salt and its LoRA adapter (b"" with neither,
    as before salts). An adapter's KV differs from the base's: it is keyed by the adapter's name and
    folder, which (unlike its int id) stay the same across restarts, for the second KV tier's files."""
    key = b""
    if request.cache_salt is not None:
        key += b"salt\0" + request.cache_salt.encode("utf-8", "surrogatepass")
    lora = request.lora_request
    if lora is not None:
        key += b"lora\0" + f"{lora.lora_name}\0{lora.lora_path}".encode("utf-8", "surrogatepass")
    return key


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window_groups: Sequence[tuple[int, int]] = (),
    ) -> None:
        """window_groups: (sliding window, num_blocks) of each KV layer group 1, 2, ... (none: one group)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        # Hashes of each request's full blocks, extended as its tokens become known.
        self.req_hashes: dict[str, list[BlockHash]] = {}
        # How many of each request's leading blocks are indexed already: a block, once hashed, stays so
        # while the request holds it, so each step indexes only the blocks it newly fills (not all of
        # them again: at 256 running requests that rescan was the scheduler's largest cost).
        self.req_num_indexed: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self.window_groups = [WindowGroup(n, block_size, w, enable_prefix_caching) for w, n in window_groups]
        # Groups 1, 2, ...: the block ids that the last successful allocate_slots added to each.
        self.new_group_block_ids: list[list[int]] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        if self.window_groups:
            return max(self.pool.usage, *(g.pool.usage for g in self.window_groups))
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of the request's full blocks (the first keyed by its cache_salt and adapter)."""
        hashes = self.req_hashes.setdefault(request.req_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            tokens = request.all_token_ids
            bs = self.block_size
            for i in range(len(hashes), num_full):
                parent = hashes[i - 1] if i else None
                extra = first_block_extra_key(request) if i == 0 else b""
                hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra))
        return hashes

    def can_hit(self, request: Request) -> bool:
        """Whether the request may start from cached blocks (the pool's or the second tier's)."""
        if not self.enable_prefix_caching:
            return False
        if request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: a hit would skip some. (Of n
            # samples only the first asks for them; the others hit the blocks it leaves cached.)
            return False
        # Mean or first-token pooling reads the hidden state of positions a hit would skip.
        return request.pooling_params is None or not request.pooling_params.needs_every_token

    def max_hit_blocks(self, request: Request) -> int:
        """At most this many leading blocks can be hits: the step must compute one token for its logits."""
        return (request.num_tokens - 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest cached prefix of a request about to be scheduled: (blocks, tokens they hold)."""
        if not self.can_hit(request):
            return [], 0
        hashes = self.block_hashes(request)
        hits: list[Block] = []
        for block_hash in hashes[: self.max_hit_blocks(request)]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        for group in self.window_groups:  # the rule: window_group.py's docstring
            hits = hits[: group.num_hit_blocks(hashes, len(hits))]
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry while it waited for blocks)."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[Block] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens, and `num_lookahead_tokens` slots past them (a draft
        model's, not computed this step); returns the ids of blocks added to the request's table (cache
        hits first), or None when the pool cannot supply them (nothing is changed then)."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.req_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens + num_lookahead_tokens) - len(blocks) - len(computed_blocks)
        if (
            num_new_blocks <= 0
            and not computed_blocks
            and not self.window_groups
            and not self._fills_blocks(request, total_tokens)
        ):
            return []  # most decode steps: the token goes into the last block and does not fill it
        # Cache hits sitting in the free queue are taken out of it, so they count against the budget.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_evictable_hits > self.pool.num_free_blocks or (
            self.window_groups
            and not self._window_groups_fit(request, len(computed_blocks), total_tokens + num_lookahead_tokens)
        ):
            if not blocks:
                del self.req_blocks[request.req_id]
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, total_tokens)
        if self.window_groups:
            self._allocate_window_groups(request, len(computed_blocks), total_tokens, num_lookahead_tokens)
        return [b.block_id for b in computed_blocks] + [b.block_id for b in new_blocks]

    def _window_groups_fit(self, request: Request, num_hit_blocks: int, num_slots: int) -> bool:
        hashes = self.block_hashes(request) if self.enable_prefix_caching else []
        num_blocks = self.blocks_needed(num_slots)
        return all(
            g.fits(request.req_id, request.num_computed_tokens, num_hit_blocks, hashes, num_blocks)
            for g in self.window_groups
        )

    def _allocate_window_groups(
        self, request: Request, num_hit_blocks: int, num_tokens: int, num_lookahead_tokens: int
    ) -> None:
        hashes = self.block_hashes(request) if self.enable_prefix_caching else []
        num_blocks = self.blocks_needed(num_tokens + num_lookahead_tokens)
        new_ids = []
        for group in self.window_groups:
            new_ids.append(
                group.allocate(request.req_id, request.num_computed_tokens, num_hit_blocks, hashes, num_blocks)
            )
            if self.enable_prefix_caching:
                group.cache_full_blocks(request.req_id, hashes, num_tokens)
        self.new_group_block_ids = new_ids

    def _fills_blocks(self, request: Request, num_tokens: int) -> bool:
        """Whether a step up to `num_tokens` fills a block that is not indexed yet."""
        if not self.enable_prefix_caching:
            return False
        return num_tokens // self.block_size > self.req_num_indexed.get(request.req_id, 0)

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        """Index the blocks that this step fills completely (their KV is written during the step)."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(request)
        start = self.req_num_indexed.get(request.req_id, 0)
        end = min(num_tokens // self.block_size, len(hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])
        if end > start:
            self.req_num_indexed[request.req_id] = end

    def free(self, request: Request) -> None:
        """Give back a request's blocks, tail first, so its last blocks are evicted before its prefix."""
        blocks = self.req_blocks.pop(request.req_id, [])
        self.pool.free_blocks(list(reversed(blocks)))
        self.req_hashes.pop(request.req_id, None)
        self.req_num_indexed.pop(request.req_id, None)
        for group in self.window_groups:
            group.free(request.req_id)

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, [])]
