"""KV layer groups: a sliding-window group frees the blocks behind its window as a request advances, a
prefix hit needs the window's blocks in that group as well as the whole prefix in group 0, and a step
gets blocks in every group or in none. Block size 16, window 24 (a query reads its block and one or two
before it) throughout."""

from __future__ import annotations

from tokenmill.kv_groups import UNBOUNDED, GroupLimits, KVGroupSpec, budget_num_blocks
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.request import Request
from tokenmill.scheduling.window_group import NULL_BLOCK_ID

BS, WINDOW = 16, 24


def manager(num_blocks: int = 64, window_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, window_groups=[(WINDOW, window_blocks)])


def make_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=1000))


def admit(kv: KVCacheManager, request: Request, budget: int) -> None:
    hits, num_cached = kv.get_computed_blocks(request)
    num_new = min(request.num_tokens - num_cached, budget)
    assert kv.allocate_slots(request, num_new, hits) is not None
    request.num_computed_tokens = num_cached + num_new


def advance(kv: KVCacheManager, request: Request, budget: int) -> None:
    """One step of a running request: its next prompt chunk, or one decoded token."""
    if request.num_computed_tokens == request.num_tokens:
        request.output_token_ids.append(7)
    num_new = min(request.num_tokens - request.num_computed_tokens, budget)
    assert kv.allocate_slots(request, num_new) is not None
    request.num_computed_tokens += num_new


def held_after_step(computed_before: int, computed_after: int) -> int:
    """The window group's blocks after a step: from the first one its first query reaches back to
    (keys j > p - window) through the one holding its last token."""
    return -(-computed_after // BS) - max(0, computed_before - WINDOW + 1) // BS


def test_a_window_group_keeps_only_the_blocks_its_window_reaches() -> None:
    kv = manager()
    window = kv.window_groups[0]
    request = make_request("a", list(range(1000, 1200)))  # 200 tokens: 13 blocks, prefilled 32 at a time
    admit(kv, request, budget=32)
    held = []
    while request.num_tokens < 260:
        before = request.num_computed_tokens
        advance(kv, request, budget=32)
        held.append(window.num_held_blocks("a"))
        assert held[-1] == held_after_step(before, request.num_computed_tokens)
    assert max(held) == 4  # a 32-token chunk (2 blocks) and the 23 tokens before it (1 or 2 blocks)
    # Decoding at 260 tokens: group 0 holds all 17 blocks, the window group 3 (positions 236..259).
    assert len(kv.req_blocks["a"]) == 17
    assert held[-1] == 3 and window.pool.num_free_blocks == 64 - 3
    window.pool.check_integrity()
    kv.free(request)
    assert window.pool.num_free_blocks == 64 and kv.pool.num_free_blocks == 64


def test_decoding_frees_the_blocks_that_fall_behind_the_window() -> None:
    kv = manager()
    window = kv.window_groups[0]
    request = make_request("a", list(range(1000, 1064)))  # 64 tokens
    admit(kv, request, budget=64)
    assert window.num_held_blocks("a") == 4  # the prompt's step writes all four
    for _ in range(64):
        advance(kv, request, budget=1)
        assert window.num_held_blocks("a") <= WINDOW // BS + 2
    # 128 tokens: 8 blocks opened; 6 freed (positions 0..95), 2 held (96..127, the window's 105..127)
    assert len(kv.req_blocks["a"]) == 8
    assert window.num_held_blocks("a") == 2 and window.pool.num_free_blocks == 64 - 2
    assert window.req_blocks["a"][:6] == [None] * 6


def test_a_prefix_hit_needs_the_window_blocks_before_it() -> None:
    """Group 0 holds the whole 64-token prefix, but the window group lost block 3 (tokens 48..63) that a
    query at 64 reads: the hit stops at 48 tokens, where blocks 1 and 2 (positions 25..47) are cached."""
    kv = manager(window_blocks=8)
    prefix = list(range(1000, 1064))
    first = make_request("a", prefix + list(range(2000, 2016)))  # 80 tokens, all in one step
    admit(kv, first, budget=80)
    kv.free(first)  # both groups keep their hashes; freed tail first, so blocks 4 then 3 are evicted first
    window = kv.window_groups[0]
    second = make_request("b", prefix + list(range(3000, 3010)))
    assert kv.get_computed_blocks(second)[1] == 64
    taken = window.pool.get_new_blocks(5)  # another request takes the 3 never used, then evicts blocks 4 and 3
    hits, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 48
    window.pool.free_blocks(taken)
    assert kv.allocate_slots(second, second.num_tokens - 48, hits) is not None
    table = window.req_blocks["b"]
    assert table[0] is None and table[1] is not None and table[2] is not None
    assert kv.new_group_block_ids[0][0] == NULL_BLOCK_ID  # the runner's placeholder for block 0


def test_a_step_gets_blocks_in_every_group_or_in_none() -> None:
    kv = manager(num_blocks=64, window_blocks=3)
    request = make_request("a", list(range(1000, 1064)))  # 4 blocks: more than the window group has
    hits, _ = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, 64, hits) is None
    assert kv.pool.num_free_blocks == 64 and "a" not in kv.req_blocks
    assert kv.window_groups[0].pool.num_free_blocks == 3 and "a" not in kv.window_groups[0].req_blocks


def test_one_group_without_window_layers() -> None:
    spec = KVGroupSpec.of_layers([None, None, None])
    assert spec.num_groups == 1 and spec.windows == ()
    assert KVCacheManager(8, BS).window_groups == []


def test_layers_grouped_by_window() -> None:
    spec = KVGroupSpec.of_layers([WINDOW, None, WINDOW, None, 4096])
    assert spec.windows == (WINDOW, 4096) and spec.layer_groups == (1, 0, 1, 0, 2)
    assert spec.layer_counts() == [2, 2, 1]


def test_window_pools_sized_by_what_they_can_hold() -> None:
    spec = KVGroupSpec.of_layers([WINDOW, None])
    limits = GroupLimits(block_size=BS, max_num_seqs=4, max_num_batched_tokens=64)
    # Each of 4 requests: 2 blocks of window + 3 of rounding and lookahead; 4 blocks of new tokens.
    assert limits.window_group_cap(WINDOW) == 4 * 5 + 4
    assert spec.pool_blocks(1000, sized_by_memory=True, limits=limits) == [1000, 24]
    assert spec.pool_blocks(1000, sized_by_memory=False, limits=limits) == [1000, 1000]


def test_the_memory_budget_buys_group_0_what_the_window_group_cannot_use() -> None:
    # 1 byte per block per group, the window group capped at 10: N + min(N, 10) <= 100.
    assert budget_num_blocks(100, [1, 1], [None, 10]) == 90
    assert budget_num_blocks(16, [1, 1], [None, 10]) == 8  # below the cap both grow together
    assert budget_num_blocks(100, [0, 1], [None, 10]) == UNBOUNDED  # every layer windowed: group 0 costs nothing
