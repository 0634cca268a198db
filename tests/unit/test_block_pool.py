"""BlockPool: reference counts, the LRU free queue, the prefix-cache index; and the block hash chain."""

from __future__ import annotations

import random

import pytest

from tokenmill.scheduling.block_pool import BlockPool, hash_block_tokens

H1 = hash_block_tokens(None, [1, 2, 3, 4])
H2 = hash_block_tokens(None, [5, 6, 7, 8])


def ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------------------------------- ref counts
def test_a_new_block_has_one_reference_and_leaves_the_free_queue() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 3
    assert pool.usage == 0.25


def test_a_shared_block_is_free_only_after_its_last_reference_is_dropped() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2

    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 3

    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_asking_for_more_blocks_than_are_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks with only 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_a_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


# ---------------------------------------------------------------------------------------- LRU order
def test_allocation_takes_the_oldest_free_block_first() -> None:
    pool = BlockPool(5)
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]


def test_freed_blocks_join_the_tail_of_the_free_queue() -> None:
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)  # free queue: 3 4 5
    pool.free_blocks([c, a])  # free queue: 3 4 5 2 0
    assert ids(pool.get_new_blocks(5)) == [3, 4, 5, 2, 0]


# ---------------------------------------------------------------------------------------- prefix index
def test_a_freed_block_keeps_its_hash_and_a_cache_hit_takes_it_back() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, H1)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 4

    hit = pool.get_cached_block(H1)
    assert hit is block
    pool.touch([hit])
    assert block.ref_cnt == 1
    assert block.block_hash == H1
    assert pool.num_free_blocks == 3
    pool.check_integrity()


def test_a_free_cached_block_survives_until_reuse_reaches_it_in_lru_order() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)  # block 0
    pool.cache_block(block, H1)
    pool.free_blocks([block])  # free queue: 1 2 0

    assert ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.get_cached_block(H1) is block  # not reached yet

    assert ids(pool.get_new_blocks(1)) == [0]
    assert pool.get_cached_block(H1) is None  # evicted by reuse


def test_evicting_a_block_removes_it_from_the_prefix_index_and_clears_its_hash() -> None:
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, H1)
    pool.free_blocks([block])

    (reused,) = pool.get_new_blocks(1)
    assert reused is block
    assert block.block_hash is None
    assert pool.get_cached_block(H1) is None
    pool.check_integrity()


def test_the_index_keeps_the_first_of_two_identical_blocks() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, H1)
    pool.cache_block(second, H1)  # same content computed twice
    assert pool.get_cached_block(H1) is first

    # Evicting the duplicate leaves the indexed block findable.
    pool.free_blocks([second])
    pool.get_new_blocks(1)
    assert pool.get_cached_block(H1) is first
    pool.check_integrity()


def test_a_block_is_cached_under_its_first_hash_only() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, H1)
    pool.cache_block(block, H2)
    assert block.block_hash == H1
    assert pool.get_cached_block(H2) is None


def test_with_caching_disabled_blocks_are_never_indexed() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, H1)
    assert block.block_hash is None
    assert pool.get_cached_block(H1) is None


def test_reset_prefix_cache_forgets_free_blocks_but_not_blocks_in_use() -> None:
    pool = BlockPool(2)
    in_use, freed = pool.get_new_blocks(2)
    pool.cache_block(in_use, H1)
    pool.cache_block(freed, H2)
    pool.free_blocks([freed])

    pool.reset_prefix_cache()
    assert pool.get_cached_block(H1) is in_use
    assert pool.get_cached_block(H2) is None
    pool.check_integrity()


# ---------------------------------------------------------------------------------------- integrity
def test_integrity_holds_after_random_allocations_frees_and_hits() -> None:
    rng = random.Random(0)
    pool = BlockPool(32)
    held: list = []  # one entry per reference taken
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            blocks = pool.get_new_blocks(rng.randint(1, min(4, pool.num_free_blocks)))
            for block in blocks:
                pool.cache_block(block, hash_block_tokens(None, [step, block.block_id]))
            held.extend(blocks)
        elif op < 0.55 and held:
            # A prefix hit on a live or a free block.
            block = rng.choice(pool.blocks)
            if block.block_hash is not None and pool.get_cached_block(block.block_hash) is block:
                pool.touch([block])
                held.append(block)
        elif held:
            rng.shuffle(held)
            pool.free_blocks([held.pop() for _ in range(rng.randint(1, len(held)))])
        pool.check_integrity()
        assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    pool.free_blocks(held)
    assert pool.num_free_blocks == 32
    pool.check_integrity()


def test_check_integrity_catches_a_block_that_is_free_and_referenced() -> None:
    pool = BlockPool(2)
    pool.blocks[0].ref_cnt = 1  # still in the free queue
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_integrity()


# ---------------------------------------------------------------------------------------- hashing
def test_block_hash_is_a_deterministic_sha256_digest() -> None:
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, [1, 2, 3, 4])
    assert len(hash_block_tokens(None, [1, 2, 3, 4])) == 32


def test_block_hash_is_chained_on_its_parent() -> None:
    tokens = [9, 9, 9, 9]
    assert hash_block_tokens(H1, tokens) != hash_block_tokens(H2, tokens)
    assert hash_block_tokens(H1, tokens) != hash_block_tokens(None, tokens)


def test_block_hash_depends_on_token_ids_their_order_and_extra_keys() -> None:
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [4, 3, 2, 1])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 4], extra=b"lora-a")
