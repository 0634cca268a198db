"""The scheduler's side of the second KV tier (scheduling/kv_tier.py), with a fake runner whose tier
keeps the hashes it was asked to save: evicted cached blocks are saved, a waiting request's prefix found
in the tier is loaded into free blocks in the step that admits it and counts as cached, a block that
fails its checks ends the loaded prefix, the tier's LRU deletes what it drops, and salts stay apart."""

from __future__ import annotations

from tests.unit.test_scheduler import BS, FakeRunner, assert_no_block_leaked, counting, make_request, step
from tokenmill.config import SchedulerConfig
from tokenmill.kv_tier.index import TierIndex
from tokenmill.kv_tier.stats import KVTierStats
from tokenmill.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.kv_tier import TierScheduler
from tokenmill.scheduling.request import Request, RequestStatus
from tokenmill.scheduling.scheduler import Scheduler


class TierRunner(FakeRunner):
    """A FakeRunner with a tier: saved hashes are kept (a step's saves land before its loads, as the
    runner's do); `fetch` finds a kept block unless it is listed in `corrupt`. Records every step."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: set[bytes] = set()
        self.corrupt: set[bytes] = set()
        self.transfers: list[SchedulerOutput] = []

    def fetch(self, hashes: list[bytes]) -> int:
        good = 0
        for h in hashes:
            if h not in self.stored or h in self.corrupt:
                break
            good += 1
        return good

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.transfers.append(out)
        self.stored |= {h for _, h in out.kv_saves}
        self.stored -= set(out.kv_deletes)
        return super().execute(out)


def make_tier_scheduler(num_blocks: int, tier_blocks: int = 64) -> tuple[Scheduler, KVTierStats, TierRunner]:
    kv = KVCacheManager(num_blocks, BS)
    stats, runner = KVTierStats(), TierRunner()
    tier = TierScheduler(kv, TierIndex(tier_blocks), stats, runner.fetch)
    return Scheduler(SchedulerConfig(), kv, kv_tier=tier), stats, runner


def run(scheduler: Scheduler, runner: TierRunner, request: Request) -> list[SchedulerOutput]:
    scheduler.add_request(request)
    outs = []
    while scheduler.has_unfinished():
        outs.append(step(scheduler, runner)[0])
    return outs


def prompt(start: int, n: int = 12) -> list[int]:
    return list(range(start, start + n))


def salted(request: Request, salt: str) -> Request:
    request.cache_salt = salt
    return request


def test_cached_blocks_taken_for_reuse_are_saved_once() -> None:
    scheduler, stats, runner = make_tier_scheduler(num_blocks=4)
    run(scheduler, runner, make_request("a", prompt=prompt(1000), max_tokens=1))  # 3 full blocks cached
    assert not any(out.kv_saves for out in runner.transfers)
    outs = run(scheduler, runner, make_request("b", prompt=prompt(2000, 15), max_tokens=1))
    saves = [s for out in outs for s in out.kv_saves]
    assert len(saves) == 3 and len({h for _, h in saves}) == 3  # a's three blocks, each once
    assert stats.num_blocks == 3 and runner.stored == {h for _, h in saves}
    assert_no_block_leaked(scheduler)


def test_a_prefix_in_the_tier_is_loaded_then_counted_as_cached() -> None:
    scheduler, stats, runner = make_tier_scheduler(num_blocks=4)
    first = make_request("a", prompt=prompt(1000), max_tokens=3)
    run(scheduler, runner, first)
    run(scheduler, runner, make_request("b", prompt=prompt(2000, 15), max_tokens=1))  # evicts a's blocks
    again = make_request("a2", prompt=prompt(1000), max_tokens=3)
    outs = run(scheduler, runner, again)
    # The admitting step loads the two blocks a lookup may use (the third holds the last prompt token) and
    # computes the rest of the prompt.
    assert len(outs[0].kv_loads) == 2 and outs[0].num_scheduled_tokens == {"a2": 12 - 2 * BS}
    assert again.num_cached_tokens == 2 * BS
    assert again.output_token_ids == first.output_token_ids == [counting(i) for i in range(3)]
    assert stats.blocks_loaded == 2 and stats.hit_tokens == 2 * BS and stats.load_failures == 0
    assert_no_block_leaked(scheduler)


def test_a_failed_load_is_a_miss_and_leaves_the_tier() -> None:
    scheduler, stats, runner = make_tier_scheduler(num_blocks=4)
    run(scheduler, runner, make_request("a", prompt=prompt(1000), max_tokens=1))
    run(scheduler, runner, make_request("b", prompt=prompt(2000, 15), max_tokens=1))
    first_hash = scheduler.kv_cache.block_hashes(make_request("probe", prompt=prompt(1000)))[0]
    runner.corrupt.add(first_hash)
    again = make_request("a2", prompt=prompt(1000), max_tokens=2)
    outs = run(scheduler, runner, again)
    assert outs[0].kv_loads == []  # the chain breaks at its first block: nothing loaded, all recomputed
    assert again.num_cached_tokens == 0
    assert again.status == RequestStatus.FINISHED_LENGTH and again.output_token_ids == [counting(0), counting(1)]
    assert stats.load_failures == 1 and first_hash not in scheduler.kv_tier.index  # type: ignore[union-attr]
    assert_no_block_leaked(scheduler)


def test_the_tier_drops_its_least_recently_used_blocks() -> None:
    scheduler, stats, runner = make_tier_scheduler(num_blocks=4, tier_blocks=3)
    for i in range(4):
        run(scheduler, runner, make_request(str(i), prompt=prompt(1000 * (i + 1), 15), max_tokens=1))
    deletes = [h for out in runner.transfers for h in out.kv_deletes]
    assert len(deletes) == 6  # request 1's blocks pushed out request 0's, request 2's request 1's
    assert stats.num_blocks == 3 and len(runner.stored) == 3
    assert not runner.stored & set(deletes)


def test_a_salted_prefix_in_the_tier_serves_only_its_salt() -> None:
    scheduler, stats, runner = make_tier_scheduler(num_blocks=4)
    run(scheduler, runner, salted(make_request("a", prompt=prompt(1000), max_tokens=1), "key-a"))
    run(scheduler, runner, make_request("b", prompt=prompt(2000, 15), max_tokens=1))
    other = salted(make_request("c", prompt=prompt(1000), max_tokens=1), "key-b")
    outs = run(scheduler, runner, other)
    assert not any(out.kv_loads for out in outs) and other.num_cached_tokens == 0
    same = salted(make_request("d", prompt=prompt(1000), max_tokens=1), "key-a")
    run(scheduler, runner, make_request("e", prompt=prompt(3000, 15), max_tokens=1))
    run(scheduler, runner, same)
    assert same.num_cached_tokens == 2 * BS


def test_a_failed_step_forgets_the_blocks_it_was_to_load() -> None:
    scheduler, _, runner = make_tier_scheduler(num_blocks=4)
    run(scheduler, runner, make_request("a", prompt=prompt(1000), max_tokens=1))
    run(scheduler, runner, make_request("b", prompt=prompt(2000, 15), max_tokens=1))
    scheduler.add_request(make_request("a2", prompt=prompt(1000), max_tokens=1))
    out = scheduler.schedule()
    assert out.kv_loads
    scheduler.step_failed(out)  # the runner raised: the loaded blocks never got their KV
    scheduler.finish_request("a2", RequestStatus.FINISHED_ERROR)
    assert all(scheduler.kv_cache.pool.get_cached_block(h) is None for _, h in out.kv_loads)
    assert_no_block_leaked(scheduler)
