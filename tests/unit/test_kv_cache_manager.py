"""KVCacheManager: blocks per request, prefix-cache hits, hit accounting, freeing. Block size 4 throughout."""

from __future__ import annotations

import pytest

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.request import Request

BS = 4


def make_request(req_id: str, prompt: list[int], **params: object) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8, **params))  # type: ignore[arg-type]


def allocate_prompt(kv: KVCacheManager, request: Request) -> list[int] | None:
    """What the scheduler does for a waiting request: look up its prefix, then allocate the rest."""
    hits, num_cached = kv.get_computed_blocks(request)
    block_ids = kv.allocate_slots(request, request.num_tokens - num_cached, hits)
    if block_ids is not None:
        request.num_computed_tokens = num_cached
    return block_ids


PROMPT_10 = list(range(100, 110))  # two full blocks and a partial one of 2 tokens


# ---------------------------------------------------------------------------------------- allocation
@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocate_slots_takes_ceil_of_tokens_over_block_size(num_tokens: int, num_blocks: int) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", list(range(num_tokens)))
    block_ids = kv.allocate_slots(request, num_tokens)
    assert block_ids is not None and len(block_ids) == num_blocks
    assert kv.pool.num_free_blocks == 8 - num_blocks


def test_decoding_adds_a_block_only_when_the_last_one_is_full() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", [1, 2, 3])
    assert kv.allocate_slots(request, 3) == [0]
    request.num_computed_tokens = 3
    request.output_token_ids.append(4)
    assert kv.allocate_slots(request, 1) == []  # token 4 of 4 fits in block 0
    request.num_computed_tokens = 4
    request.output_token_ids.append(5)
    assert kv.allocate_slots(request, 1) == [1]  # token 5 opens block 1
    assert kv.get_block_ids("a") == [0, 1]


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_too_small() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    request = make_request("a", list(range(9)))  # needs 3 blocks
    assert kv.allocate_slots(request, 9) is None
    assert kv.pool.num_free_blocks == 2
    assert "a" not in kv.req_blocks
    kv.pool.check_integrity()


def test_a_running_request_that_cannot_grow_keeps_the_blocks_it_has() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    request = make_request("a", list(range(8)))
    assert kv.allocate_slots(request, 8) == [0, 1]
    request.num_computed_tokens = 8
    request.output_token_ids.append(0)
    assert kv.allocate_slots(request, 1) is None
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.pool.num_free_blocks == 0
    kv.pool.check_integrity()


# ---------------------------------------------------------------------------------------- prefix hits
def test_a_second_request_with_the_same_prompt_gets_its_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = make_request("a", PROMPT_10)
    allocate_prompt(kv, first)

    second = make_request("b", PROMPT_10)
    hits, num_cached = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits] == kv.get_block_ids("a")[:2]
    assert num_cached == 8


def test_a_prefix_hit_always_leaves_at_least_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt_8 = list(range(100, 108))  # exactly two full blocks
    allocate_prompt(kv, make_request("a", prompt_8))

    hits, num_cached = kv.get_computed_blocks(make_request("b", prompt_8))
    assert num_cached == 4  # the second block holds the last token: it is recomputed for its logits
    assert len(hits) == 1


def test_a_partial_last_block_is_not_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    allocate_prompt(kv, make_request("a", PROMPT_10))
    partial = kv.req_blocks["a"][2]
    assert partial.block_hash is None

    # A longer prompt that extends PROMPT_10 finds only the two full blocks.
    _, num_cached = kv.get_computed_blocks(make_request("b", PROMPT_10 + [110, 111, 112]))
    assert num_cached == 8


def test_a_different_first_block_means_no_hit_even_if_later_tokens_match() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    allocate_prompt(kv, make_request("a", PROMPT_10))
    _, num_cached = kv.get_computed_blocks(make_request("b", [0, 0, 0, 0] + PROMPT_10[4:]))
    assert num_cached == 0


def test_blocks_filled_by_generated_tokens_are_cached_too() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    allocate_prompt(kv, request)
    request.num_computed_tokens = 6
    request.output_token_ids += [7, 8]
    kv.allocate_slots(request, 2)  # computes tokens 7 and 8, filling block 1

    _, num_cached = kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert num_cached == 8


def test_each_step_indexes_only_the_blocks_it_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    indexed: list[int] = []
    cache_block = kv.pool.cache_block
    monkeypatch.setattr(kv.pool, "cache_block", lambda b, h: (indexed.append(b.block_id), cache_block(b, h)))
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    allocate_prompt(kv, request)
    assert indexed == [0]  # the prompt fills block 0
    request.num_computed_tokens = 6
    for token in range(7, 15):  # 8 decode steps: tokens 7-14 fill blocks 1 and 2
        request.output_token_ids.append(token)
        kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    assert indexed == [0, 1, 2]  # each block once, in the step that filled it
    kv.free(request)
    again = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # the same id after a free starts afresh
    allocate_prompt(kv, again)
    assert kv.get_computed_blocks(again)[1] == 8


def test_shared_prefix_blocks_are_reference_counted() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first, second = make_request("a", PROMPT_10), make_request("b", PROMPT_10)
    allocate_prompt(kv, first)
    allocate_prompt(kv, second)
    assert second.num_computed_tokens == 8
    shared = kv.req_blocks["a"][:2]
    assert kv.req_blocks["b"][:2] == shared
    assert [b.ref_cnt for b in shared] == [2, 2]
    assert kv.pool.num_free_blocks == 16 - 4  # 3 blocks for a, one more for b's last 2 tokens

    kv.free(first)
    assert [b.ref_cnt for b in shared] == [1, 1]
    kv.pool.check_integrity()


def test_a_freed_request_leaves_its_prefix_for_the_next_one() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = make_request("a", PROMPT_10)
    allocate_prompt(kv, first)
    prefix = kv.get_block_ids("a")[:2]
    kv.free(first)

    second = make_request("b", PROMPT_10)
    block_ids = allocate_prompt(kv, second)
    assert block_ids is not None and block_ids[:2] == prefix
    assert kv.pool.num_free_blocks == 16 - 3
    kv.pool.check_integrity()


def test_free_cache_hits_count_against_the_pool_when_allocating() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    prompt_8 = list(range(100, 108))
    first = make_request("a", prompt_8)
    allocate_prompt(kv, first)
    kv.free(first)  # blocks 0 and 1 are free but cached
    kv.allocate_slots(make_request("other", [1]), 1)  # takes block 2, the only uncached free one

    # Both free blocks hit, but the third block it needs would have to evict one of them.
    second = make_request("b", prompt_8 + [108, 109, 110, 111])
    assert allocate_prompt(kv, second) is None
    assert kv.pool.num_free_blocks == 2
    assert all(b.ref_cnt == 0 and b.block_hash is not None for b in kv.pool.blocks[:2])
    kv.pool.check_integrity()


def test_a_request_asking_for_prompt_logprobs_gets_no_prefix_hits() -> None:
    # A hit would skip the prompt positions whose logprobs it asked for.
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    allocate_prompt(kv, make_request("a", PROMPT_10))
    assert kv.get_computed_blocks(make_request("b", PROMPT_10, prompt_logprobs=1)) == ([], 0)


def test_with_prefix_caching_disabled_nothing_is_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    allocate_prompt(kv, make_request("a", PROMPT_10))
    assert kv.get_computed_blocks(make_request("b", PROMPT_10)) == ([], 0)
    assert all(b.block_hash is None for b in kv.pool.blocks)


# ---------------------------------------------------------------------------------------- accounting
def test_prefix_cache_queries_and_hits_are_counted_in_tokens() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    kv.record_lookup(10, 0)
    kv.record_lookup(10, 8)
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)
    assert kv.stats.hit_rate == pytest.approx(8 / 20)


def test_hit_rate_is_zero_before_any_query() -> None:
    assert KVCacheManager(num_blocks=1, block_size=BS).stats.hit_rate == 0.0


# ---------------------------------------------------------------------------------------- freeing
def test_free_returns_every_block_to_the_pool() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    requests = [make_request(str(i), list(range(i * 100, i * 100 + 3 + 2 * i))) for i in range(5)]
    for request in requests:
        allocate_prompt(kv, request)
    for request in requests:
        kv.free(request)
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert kv.req_blocks == {} and kv.req_hashes == {}
    kv.pool.check_integrity()


def test_free_puts_a_request_tail_block_first_in_line_for_eviction() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    request = make_request("a", list(range(12)))
    allocate_prompt(kv, request)  # blocks 0 1 2
    kv.free(request)
    # The tail goes first, so the prefix (most likely to be shared) stays cached longest.
    assert [b.block_id for b in kv.pool.get_new_blocks(3)] == [2, 1, 0]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


def test_lookahead_slots_are_allocated_but_never_cached_before_they_are_computed() -> None:
    """A draft model's lookahead past a prefill chunk must not index the prompt blocks the chunk has
    not computed yet: another request would hit blocks whose KV is unwritten."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", PROMPT_10)
    block_ids = kv.allocate_slots(request, 3, num_lookahead_tokens=4)  # a chunk of 3 tokens, 4 lookahead
    assert block_ids is not None and len(block_ids) == 2  # 7 slots
    other = make_request("b", PROMPT_10)
    assert kv.get_computed_blocks(other) == ([], 0)  # block 0 (tokens 0-3) is not computed yet
