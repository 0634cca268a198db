"""Scheduler, driven by a fake runner with hand-written outputs: no model, no torch.

Block size 4 throughout. The fake runner samples token 100 + i as a request's i-th output token, so a
request that finishes with outputs 100, 101, ... lost and repeated nothing, even across preemptions."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.online_traffic import ONLINE_QUIET_S
from tokenmill.scheduling.request import BACKGROUND_PRIORITY, Request, RequestStatus
from tokenmill.scheduling.scheduler import Scheduler

BS = 4
EOS = 2
_prompt_starts = itertools.count(1000, 1000)


def make_scheduler(num_blocks: int = 64, **config: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, BS))  # type: ignore[arg-type]


def make_request(
    req_id: str,
    prompt_len: int = 8,
    max_tokens: int = 4,
    *,
    prompt: list[int] | None = None,
    priority: int = 0,
    arrival: float = 0.0,
    leader: Request | None = None,
    **params: object,
) -> Request:
    """A request whose prompt (unless given) shares no token with any other test prompt."""
    if prompt is None:
        start = next(_prompt_starts)
        prompt = list(range(start, start + prompt_len))
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        arrival_time=arrival,
        prefill_leader=leader,
    )


def counting(i: int) -> int:
    return 100 + i


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int


class FakeRunner:
    """Keeps what a model runner keeps per request, built only from SchedulerOutputs, and checks the
    contract on the way: cached requests agree on progress, and every scheduled token has a KV slot.
    `sample(i)` is the i-th output token of every request."""

    def __init__(self, sample: Callable[[int], int] = counting) -> None:
        self.sample = sample
        self.states: dict[str, _RunnerState] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.new_requests:
            assert new.req_id not in self.states
            self.states[new.req_id] = _RunnerState(
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids),
                new.num_computed_tokens,
                len(new.prompt_token_ids),
            )
        for cached in out.cached_requests:
            state = self.states[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids += cached.new_block_ids
        sampled: dict[str, list[int]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            state.num_computed_tokens += n
            assert state.num_computed_tokens <= len(state.token_ids)
            assert state.num_computed_tokens <= len(state.block_ids) * BS, "a scheduled token has no KV slot"
            if state.num_computed_tokens == len(state.token_ids):
                token = self.sample(len(state.token_ids) - state.num_prompt_tokens)
                state.token_ids.append(token)
                sampled[req_id] = [token]
        return ModelRunnerOutput(sampled)


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner.execute(out))


def steps(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> Iterator[SchedulerOutput]:
    """Step until every request has finished, yielding each step's SchedulerOutput."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        yield step(scheduler, runner)[0]
    raise AssertionError("the scheduler stopped making progress")


def run_to_completion(scheduler: Scheduler, runner: FakeRunner) -> list[SchedulerOutput]:
    return list(steps(scheduler, runner))


def assert_no_block_leaked(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert kv.req_blocks == {}
    kv.pool.check_integrity()


# ---------------------------------------------------------------------------------------- budgets
def test_the_token_budget_holds_every_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for i in range(6):
        scheduler.add_request(make_request(str(i), prompt_len=13, max_tokens=5))
    outs = run_to_completion(scheduler, FakeRunner())
    assert all(out.total_num_scheduled_tokens <= 10 for out in outs)
    assert all(out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) for out in outs)
    assert max(out.total_num_scheduled_tokens for out in outs) == 10  # the budget is used, not just kept


def test_max_num_seqs_caps_the_batch_every_step() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(str(i), prompt_len=5, max_tokens=3) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    running_counts = []
    for out in steps(scheduler, FakeRunner()):
        assert len(out.num_scheduled_tokens) <= 2
        running_counts.append(scheduler.num_running)
    assert max(running_counts) == 2
    assert all(r.num_output_tokens == 3 for r in requests)


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("long", prompt_len=20, max_tokens=3)
    scheduler.add_request(request)

    chunks, tokens_after = [], []
    for out in steps(scheduler, FakeRunner()):
        chunks.append(out.num_scheduled_tokens["long"])
        tokens_after.append(request.num_output_tokens)

    assert chunks == [8, 8, 4, 1, 1]  # 8 + 8 + 4 = 20 prompt tokens, then one decode per step
    assert tokens_after == [0, 0, 1, 2, 3]  # a partial chunk samples nothing
    assert request.output_token_ids == [100, 101, 102]


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("running", prompt_len=16))
    runner = FakeRunner()
    step(scheduler, runner)  # "running" computes 10 of its 16 prompt tokens

    scheduler.add_request(make_request("waiting", prompt_len=8))
    out, _ = step(scheduler, runner)
    assert list(out.num_scheduled_tokens) == ["running", "waiting"]
    assert out.num_scheduled_tokens == {"running": 6, "waiting": 4}  # the waiting one gets what is left


def test_prefill_and_decode_share_a_step() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("decoding", prompt_len=4, max_tokens=5))
    runner = FakeRunner()
    step(scheduler, runner)

    scheduler.add_request(make_request("prefilling", prompt_len=8))
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"decoding": 1, "prefilling": 8}
    assert [c.req_id for c in out.cached_requests] == ["decoding"]
    assert [n.req_id for n in out.new_requests] == ["prefilling"]


def test_an_idle_scheduler_schedules_nothing() -> None:
    out = make_scheduler().schedule()
    assert out.is_empty
    assert out.new_requests == [] and out.cached_requests == []


# ---------------------------------------------------------------------------------------- prefix cache
def test_a_repeated_prompt_starts_from_its_cached_blocks() -> None:
    scheduler = make_scheduler()
    prompt = list(range(500, 510))
    runner = FakeRunner()
    scheduler.add_request(make_request("first", prompt=prompt))
    run_to_completion(scheduler, runner)

    again = make_request("again", prompt=prompt)
    scheduler.add_request(again)
    out, _ = step(scheduler, runner)
    assert out.new_requests[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"again": 2}
    assert again.num_cached_tokens == 8


def test_a_prefix_lookup_is_counted_once_per_admission_not_per_retry() -> None:
    # 6 blocks: "big" (16 tokens) takes 4, evicting the tail of "first" but not its two prompt
    # blocks; "again" needs those 2 plus 1 new, so it retries its lookup until "big" ends.
    scheduler = make_scheduler(num_blocks=6)
    prompt = list(range(500, 510))
    runner = FakeRunner()
    scheduler.add_request(make_request("first", prompt=prompt))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("big", prompt_len=16, max_tokens=1))
    scheduler.add_request(make_request("again", prompt=prompt))
    first_step, _ = step(scheduler, runner)
    assert list(first_step.num_scheduled_tokens) == ["big"]  # "again" looked up its prefix and waited
    run_to_completion(scheduler, runner)
    stats = scheduler.kv_cache.stats
    assert (stats.queries, stats.hits) == (10 + 16 + 10, 8)


# ---------------------------------------------------------------------------------------- freeing
def test_no_block_leaks_once_all_requests_finish() -> None:
    rng = random.Random(1)
    scheduler = make_scheduler(num_blocks=40, max_num_batched_tokens=16, max_num_seqs=4)
    shared = list(range(700, 710))  # half the prompts share a prefix, so blocks are shared too
    requests = []
    for i in range(12):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 99) for _ in range(rng.randint(1, 12))]
        requests.append(make_request(str(i), prompt=prompt, max_tokens=rng.randint(1, 8)))
        scheduler.add_request(requests[-1])
    run_to_completion(scheduler, FakeRunner())
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert_no_block_leaked(scheduler)


def test_aborting_a_waiting_request_removes_it_and_it_is_never_scheduled() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    first, second = make_request("first"), make_request("second")
    scheduler.add_request(first)
    scheduler.add_request(second)
    runner = FakeRunner()
    step(scheduler, runner)

    scheduler.finish_request("second", RequestStatus.FINISHED_ABORTED)
    assert second.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.num_waiting == 0
    outs = run_to_completion(scheduler, runner)
    assert all("second" not in out.num_scheduled_tokens for out in outs)
    assert "second" in outs[0].finished_req_ids
    assert second.output_token_ids == []
    assert_no_block_leaked(scheduler)


@pytest.mark.parametrize("steps_before_abort", [1, 3], ids=["mid-prefill", "mid-decode"])
def test_aborting_a_running_request_returns_its_blocks(steps_before_abort: int) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6)
    victim, other = make_request("victim", prompt_len=10, max_tokens=8), make_request("other", prompt_len=3)
    scheduler.add_request(victim)
    scheduler.add_request(other)
    runner = FakeRunner()
    for _ in range(steps_before_abort):
        step(scheduler, runner)
    assert victim.status == RequestStatus.RUNNING and scheduler.kv_cache.get_block_ids("victim")

    scheduler.finish_request("victim", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache.get_block_ids("victim") == []
    outs = run_to_completion(scheduler, runner)
    assert "victim" in outs[0].finished_req_ids
    assert all("victim" not in out.num_scheduled_tokens for out in outs)
    assert other.num_output_tokens == 4
    assert_no_block_leaked(scheduler)


def test_a_request_aborted_while_its_step_runs_gets_no_token() -> None:
    scheduler = make_scheduler()
    request = make_request("a")
    scheduler.add_request(request)
    runner = FakeRunner()
    out = scheduler.schedule()
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(out, runner.execute(out)) == []
    assert request.output_token_ids == []
    assert_no_block_leaked(scheduler)


def test_aborting_an_unknown_or_finished_request_is_a_no_op() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", max_tokens=1))
    run_to_completion(scheduler, FakeRunner())
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("never-added", RequestStatus.FINISHED_ABORTED)
    assert_no_block_leaked(scheduler)


# ---------------------------------------------------------------------------------------- preemption
def _three_requests_outgrowing_six_blocks(
    policy: str, priorities: list[int], waiting: tuple[Request, ...] = ()
) -> tuple[Scheduler, FakeRunner, list[Request]]:
    """a, b, c (arriving in that order) each have a 4-token prompt and want 8 tokens: 3 blocks each, 9 in
    all, from a pool of 6. Their third blocks are needed at step 6; returns the scheduler before it.
    With max_num_seqs 3, requests in `waiting` stay waiting meanwhile."""
    scheduler = make_scheduler(num_blocks=6, policy=policy, max_num_seqs=3)
    requests = [
        make_request(name, prompt_len=4, max_tokens=8, priority=prio, arrival=float(i))
        for i, (name, prio) in enumerate(zip("abc", priorities))
    ]
    for request in [*requests, *waiting]:
        scheduler.add_request(request)
    runner = FakeRunner()
    for _ in range(5):
        step(scheduler, runner)
    assert scheduler.stats.num_preemptions == 0
    assert scheduler.kv_cache.pool.num_free_blocks == 0
    return scheduler, runner, requests


@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [
        ("fcfs", [0, 0, 0], "c"),  # the latest arrival
        ("fcfs", [1, 0, 0], "c"),  # priorities mean nothing to fcfs
        ("priority", [0, 0, 0], "c"),  # equal priority: the latest arrival
        ("priority", [1, 0, 0], "a"),  # the lowest priority (highest value), though it came first
    ],
)
def test_the_preemption_victim_is_the_lowest_priority_latest_arrived_running_request(
    policy: str, priorities: list[int], victim: str
) -> None:
    scheduler, runner, requests = _three_requests_outgrowing_six_blocks(policy, priorities)
    out, _ = step(scheduler, runner)
    preempted = [r.req_id for r in requests if r.status == RequestStatus.PREEMPTED]
    assert preempted == [victim]
    assert sorted(out.num_scheduled_tokens) == sorted(set("abc") - {victim})


def test_a_preemption_is_counted_in_stats_and_on_the_request() -> None:
    scheduler, runner, (a, b, c) = _three_requests_outgrowing_six_blocks("fcfs", [0, 0, 0])
    step(scheduler, runner)
    assert scheduler.stats.num_preemptions == 1
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 1)


def test_a_preempted_request_gives_back_its_blocks_and_progress() -> None:
    scheduler, runner, (_, _, c) = _three_requests_outgrowing_six_blocks("fcfs", [0, 0, 0])
    step(scheduler, runner)
    assert scheduler.kv_cache.get_block_ids("c") == []
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == [100, 101, 102, 103, 104]  # its outputs are kept
    assert scheduler.num_waiting == 1
    scheduler.kv_cache.pool.check_integrity()


def test_the_runner_is_told_to_drop_a_preempted_request_in_the_step_that_preempts_it() -> None:
    scheduler, runner, _ = _three_requests_outgrowing_six_blocks("fcfs", [0, 0, 0])
    out, _ = step(scheduler, runner)
    assert out.finished_req_ids == {"c"}
    assert "c" not in runner.states


def test_a_preempted_request_comes_back_as_a_new_request_with_its_outputs_so_far() -> None:
    scheduler, runner, (_, _, c) = _three_requests_outgrowing_six_blocks("fcfs", [0, 0, 0])
    step(scheduler, runner)  # c is preempted
    out = next(out for out in steps(scheduler, runner) if "c" in {n.req_id for n in out.new_requests})
    (resumed,) = [n for n in out.new_requests if n.req_id == "c"]
    assert resumed.prompt_token_ids == c.prompt_token_ids
    assert resumed.output_token_ids == [100, 101, 102, 103, 104]
    # It recomputes prompt and outputs (less any cache hits) before it samples again.
    assert out.num_scheduled_tokens["c"] == 9 - resumed.num_computed_tokens
    assert c.status == RequestStatus.RUNNING


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_every_request_finishes_with_all_its_tokens_despite_preemption(policy: str) -> None:
    scheduler, runner, requests = _three_requests_outgrowing_six_blocks(policy, [1, 0, 0])
    run_to_completion(scheduler, runner)
    assert scheduler.stats.num_preemptions >= 1
    for request in requests:
        assert request.output_token_ids == list(range(100, 108))
        assert request.status == RequestStatus.FINISHED_LENGTH
    assert_no_block_leaked(scheduler)


def test_a_higher_priority_request_admitted_later_is_not_the_victim() -> None:
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    low = make_request("low", prompt_len=4, max_tokens=8, priority=1, arrival=0.0)
    scheduler.add_request(low)
    runner = FakeRunner()
    step(scheduler, runner)  # "low" runs alone first
    high = make_request("high", prompt_len=4, max_tokens=8, priority=0, arrival=1.0)
    scheduler.add_request(high)  # it joins the running list after "low"

    for _ in range(10):
        step(scheduler, runner)
        if scheduler.stats.num_preemptions:
            break
    assert low.status == RequestStatus.PREEMPTED
    assert high.status == RequestStatus.RUNNING


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_background_request_sits_out_every_step_another_request_wants(policy: str) -> None:
    scheduler = make_scheduler(policy=policy)
    runner = FakeRunner()
    batch = make_request("batch", prompt_len=4, max_tokens=20, priority=BACKGROUND_PRIORITY, arrival=0.0)
    scheduler.add_request(batch)
    out, _ = step(scheduler, runner)
    assert set(out.num_scheduled_tokens) == {"batch"}  # alone, it runs
    online = make_request("online", prompt_len=6, max_tokens=3, arrival=1.0)
    scheduler.add_request(online)
    while online.status != RequestStatus.FINISHED_LENGTH:
        out, _ = step(scheduler, runner)
        assert "batch" not in out.num_scheduled_tokens  # neither beside the prompt nor beside decodes
        assert batch.status == RequestStatus.RUNNING  # it keeps its blocks and its progress
    out, _ = step(scheduler, runner)
    assert set(out.num_scheduled_tokens) == {"batch"}  # and runs again once it is alone
    run_to_completion(scheduler, runner)
    assert batch.output_token_ids == [counting(i) for i in range(20)]
    assert_no_block_leaked(scheduler)


def test_right_after_online_traffic_an_idle_class_step_computes_one_short_prompt_chunk() -> None:
    now = [0.0]
    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(64, BS), idle_chunk_tokens=3, clock=lambda: now[0])
    runner = FakeRunner()
    scheduler.add_request(make_request("online", prompt_len=8, max_tokens=2))
    assert [out.num_scheduled_tokens for out in run_to_completion(scheduler, runner)] == [{"online": 8}, {"online": 1}]
    now[0] = ONLINE_QUIET_S - 0.1
    a = make_request("a", prompt_len=2, max_tokens=6, priority=BACKGROUND_PRIORITY)
    b = make_request("b", prompt_len=8, max_tokens=2, priority=BACKGROUND_PRIORITY)
    scheduler.add_request(a)
    scheduler.add_request(b)
    # 3 prompt tokens a step between them; a's decode rows pass, as does b's last prompt token.
    expected = [{"a": 2, "b": 1}, {"a": 1, "b": 3}, {"a": 1, "b": 3}, {"a": 1, "b": 1}]
    assert [step(scheduler, runner)[0].num_scheduled_tokens for _ in expected] == expected
    now[0] = ONLINE_QUIET_S  # quiet since the online request's last step: whole prompts again
    scheduler.add_request(make_request("c", prompt_len=8, max_tokens=1, priority=BACKGROUND_PRIORITY))
    assert step(scheduler, runner)[0].num_scheduled_tokens == {"a": 1, "b": 1, "c": 8}
    run_to_completion(scheduler, runner)
    assert a.output_token_ids == [counting(i) for i in range(6)] and b.output_token_ids == [counting(0), counting(1)]
    assert_no_block_leaked(scheduler)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_waiting_request_preempts_background_requests_that_hold_the_blocks(policy: str) -> None:
    scheduler = make_scheduler(num_blocks=4, policy=policy)
    runner = FakeRunner()
    background = [make_request(f"b{i}", prompt_len=8, max_tokens=4, priority=BACKGROUND_PRIORITY) for i in range(2)]
    for request in background:  # their prompts fill the pool: 2 blocks each
        scheduler.add_request(request)
    step(scheduler, runner)
    online = make_request("online", prompt_len=8, max_tokens=2, arrival=1.0)  # needs 2 of the 4 blocks
    scheduler.add_request(online)
    out, _ = step(scheduler, runner)
    assert [n.req_id for n in out.new_requests] == ["online"]
    assert out.finished_req_ids == {"b1"}  # the last background request gave its blocks back
    run_to_completion(scheduler, runner)
    assert [r.output_token_ids for r in background] == [[counting(i) for i in range(4)]] * 2
    assert_no_block_leaked(scheduler)


def test_a_preempted_request_goes_back_to_the_front_of_the_fcfs_queue() -> None:
    d = make_request("d", prompt_len=4, max_tokens=1, arrival=3.0)
    scheduler, runner, _ = _three_requests_outgrowing_six_blocks("fcfs", [0, 0, 0], waiting=(d,))
    step(scheduler, runner)  # c is preempted while d has been waiting since the start
    assert [r.req_id for r in scheduler.waiting] == ["c", "d"]
    admitted = [n.req_id for out in run_to_completion(scheduler, runner) for n in out.new_requests]
    assert admitted == ["c", "d"]


def test_a_step_that_preempts_admits_no_waiting_request() -> None:
    scheduler = make_scheduler(num_blocks=3, policy="priority")
    scheduler.add_request(make_request("a", prompt_len=4, arrival=0.0))  # 1 block, needs a 2nd next step
    scheduler.add_request(make_request("c", prompt_len=8, arrival=1.0))  # 2 blocks
    runner = FakeRunner()
    step(scheduler, runner)
    scheduler.add_request(make_request("urgent", prompt_len=2, priority=-1, arrival=2.0))

    out, _ = step(scheduler, runner)  # a preempts c and leaves one block free, enough for "urgent"
    assert out.finished_req_ids == {"c"}
    assert out.new_requests == []  # blocks are short: no new work this step
    out, _ = step(scheduler, runner)
    assert [n.req_id for n in out.new_requests] == ["urgent"]


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_last_in_line() -> None:
    scheduler = make_scheduler(num_blocks=3)
    first = make_request("first", prompt_len=6, max_tokens=4, arrival=0.0)  # 2 blocks
    last = make_request("last", prompt_len=4, max_tokens=4, arrival=1.0)  # 1 block, full
    scheduler.add_request(first)
    scheduler.add_request(last)
    runner = FakeRunner()
    step(scheduler, runner)

    out, _ = step(scheduler, runner)  # "last" needs a second block; none is free
    assert out.num_scheduled_tokens == {"first": 1}
    assert out.finished_req_ids == {"last"}
    assert last.status == RequestStatus.PREEMPTED
    run_to_completion(scheduler, runner)
    assert last.output_token_ids == [100, 101, 102, 103]
    assert_no_block_leaked(scheduler)


def test_no_block_leaks_after_preemptions_and_aborts_in_every_state() -> None:
    rng = random.Random(2)
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=12, max_num_seqs=6)
    requests = [
        make_request(str(i), prompt_len=rng.randint(1, 14), max_tokens=rng.randint(1, 10), arrival=float(i))
        for i in range(16)
    ]
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner()
    # Abort the first request seen in each of these states.
    to_abort = [RequestStatus.PREEMPTED, RequestStatus.WAITING, RequestStatus.RUNNING]
    aborted = []
    for _ in range(400):
        if not scheduler.has_unfinished():
            break
        step(scheduler, runner)
        for status in list(to_abort):
            in_state = [r for r in scheduler.requests.values() if r.status == status]
            if in_state:
                scheduler.finish_request(in_state[0].req_id, RequestStatus.FINISHED_ABORTED)
                aborted.append(in_state[0])
                to_abort.remove(status)
        scheduler.kv_cache.pool.check_integrity()
    assert not scheduler.has_unfinished()
    assert to_abort == [] and scheduler.stats.num_preemptions > 0
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    for request in requests:
        if request not in aborted:
            assert request.output_token_ids == list(range(100, 100 + request.max_tokens)), request.req_id
    assert_no_block_leaked(scheduler)


# ---------------------------------------------------------------------------------------- policies
def _order_served(policy: str, priorities: list[int]) -> list[str]:
    scheduler = make_scheduler(max_num_seqs=1, policy=policy)
    for i, prio in enumerate(priorities):
        scheduler.add_request(make_request(f"p{prio}-t{i}", max_tokens=1, priority=prio, arrival=float(i)))
    return [out.new_requests[0].req_id for out in run_to_completion(scheduler, FakeRunner())]


def test_the_priority_policy_serves_the_lowest_value_first_then_the_earliest_arrival() -> None:
    assert _order_served("priority", [2, 0, 1, 0]) == ["p0-t1", "p0-t3", "p1-t2", "p2-t0"]


def test_the_fcfs_policy_serves_in_arrival_order_whatever_the_priority() -> None:
    assert _order_served("fcfs", [2, 0, 1, 0]) == ["p2-t0", "p0-t1", "p1-t2", "p0-t3"]


# ---------------------------------------------------------------------------------------- admission
def test_check_fits_accepts_a_request_of_exactly_max_model_len() -> None:
    make_scheduler(max_model_len=32).check_fits(num_prompt_tokens=20, max_tokens=12)


def test_check_fits_rejects_prompt_plus_max_tokens_over_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match=r"= 33 exceeds max_model_len \(32\)"):
        scheduler.check_fits(num_prompt_tokens=20, max_tokens=13)


def test_check_fits_rejects_a_request_needing_more_blocks_than_exist() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    scheduler.check_fits(num_prompt_tokens=10, max_tokens=6)  # 16 tokens = 4 blocks
    with pytest.raises(ValueError, match="needs 5 KV blocks but the cache has only 4"):
        scheduler.check_fits(num_prompt_tokens=10, max_tokens=7)


def test_check_fits_rejects_an_empty_prompt() -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        make_scheduler().check_fits(num_prompt_tokens=0, max_tokens=1)


def test_a_rejected_request_leaves_the_scheduler_untouched() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("empty", prompt=[]))
    assert not scheduler.has_unfinished() and scheduler.num_waiting == 0


def test_a_request_id_in_use_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a"))


# ---------------------------------------------------------------------------------------- stopping
def test_a_request_stops_at_max_tokens_with_reason_length() -> None:
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=3)
    scheduler.add_request(request)
    runner = FakeRunner()
    outputs = [step(scheduler, runner)[1] for _ in range(3)]
    assert request.output_token_ids == [100, 101, 102]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert outputs[-1][0].finish_reason == "length"
    assert [o[0].finished for o in outputs] == [False, False, True]


def test_eos_stops_a_request_and_is_kept_as_its_last_token() -> None:
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=10)
    scheduler.add_request(request)
    run_to_completion(scheduler, FakeRunner(sample=lambda i: EOS if i == 2 else 100 + i))
    assert request.output_token_ids == [100, 101, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason is None


def test_a_stop_token_id_stops_a_request_and_is_its_stop_reason() -> None:
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=10, stop_token_ids=[101])
    scheduler.add_request(request)
    runner = FakeRunner()
    (out,) = step(scheduler, runner)[1]
    (out,) = step(scheduler, runner)[1]
    assert (out.finish_reason, out.stop_reason) == ("stop", 101)
    assert request.output_token_ids == [100, 101]


def test_eos_before_min_tokens_does_not_stop_a_request() -> None:
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=10, min_tokens=3)
    scheduler.add_request(request)
    run_to_completion(scheduler, FakeRunner(sample=lambda i: EOS))
    assert request.output_token_ids == [EOS, EOS, EOS]  # the third token may stop it
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=4, ignore_eos=True)
    scheduler.add_request(request)
    run_to_completion(scheduler, FakeRunner(sample=lambda i: EOS))
    assert request.output_token_ids == [EOS] * 4
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_ignore_eos_still_honours_stop_token_ids() -> None:
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=10, ignore_eos=True, stop_token_ids=[EOS])
    scheduler.add_request(request)
    run_to_completion(scheduler, FakeRunner(sample=lambda i: EOS))
    assert request.output_token_ids == [EOS]
    assert request.stop_reason == EOS


def test_a_finished_request_frees_its_blocks_and_is_reported_in_the_next_step() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("short", max_tokens=1))
    scheduler.add_request(make_request("long", max_tokens=3))
    runner = FakeRunner()
    step(scheduler, runner)
    assert scheduler.kv_cache.get_block_ids("short") == []
    out, _ = step(scheduler, runner)
    assert out.finished_req_ids == {"short"}
    out, _ = step(scheduler, runner)
    assert out.finished_req_ids == set()  # reported once


# ---------------------------------------------------------------------------------------- n > 1
def test_a_sibling_waits_for_its_leader_prompt_then_hits_its_blocks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    prompt = list(range(300, 310))
    leader = make_request("s#0", prompt=prompt)
    sibling = make_request("s#1", prompt=prompt, leader=leader)
    scheduler.add_request(leader)
    scheduler.add_request(sibling)
    runner = FakeRunner()

    for _ in range(3):  # the leader's 10 prompt tokens, in chunks of 4, 4, 2
        out, _ = step(scheduler, runner)
        assert "s#1" not in out.num_scheduled_tokens
    assert leader.prompt_done()

    out, _ = step(scheduler, runner)
    (new,) = out.new_requests
    assert new.req_id == "s#1"
    assert new.num_computed_tokens == 8
    assert new.block_ids[:2] == scheduler.kv_cache.get_block_ids("s#0")[:2]
    assert out.num_scheduled_tokens == {"s#0": 1, "s#1": 2}
    assert sibling.num_cached_tokens == 8


def test_a_waiting_sibling_does_not_hold_up_the_requests_behind_it() -> None:
    scheduler = make_scheduler()
    leader = make_request("s#0", prompt_len=10)
    scheduler.add_request(leader)
    for i in (1, 2):
        scheduler.add_request(make_request(f"s#{i}", prompt=leader.prompt_token_ids, leader=leader))
    scheduler.add_request(make_request("other"))
    out, _ = step(scheduler, FakeRunner())
    assert sorted(out.num_scheduled_tokens) == ["other", "s#0"]
    assert [r.req_id for r in scheduler.waiting] == ["s#1", "s#2"]  # still in their order


def test_a_sibling_of_an_aborted_leader_goes_ahead() -> None:
    scheduler = make_scheduler()
    leader = make_request("s#0", prompt_len=10)
    sibling = make_request("s#1", prompt=leader.prompt_token_ids, leader=leader, max_tokens=2)
    scheduler.add_request(leader)
    scheduler.add_request(sibling)
    scheduler.finish_request("s#0", RequestStatus.FINISHED_ABORTED)
    out, _ = step(scheduler, FakeRunner())
    assert out.num_scheduled_tokens == {"s#1": 10}


# ---------------------------------------------------------------------------------------- steps in flight
def pipelined_run(scheduler: Scheduler, runner: FakeRunner, depth: int, max_steps: int = 1000) -> int:
    """The engine's pipelined loop (pipeline stages): up to `depth` steps launched before the oldest's
    output is taken; the runner computes at launch, the scheduler learns at collect. Returns the most
    steps that were in flight at once, and checks that those steps never share a request."""
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    most = 0
    for _ in range(max_steps):
        if not scheduler.has_unfinished() and not in_flight:
            return most
        while len(in_flight) < depth:
            out = scheduler.schedule()
            if out.is_empty:
                scheduler.not_launched(out)
                break
            held = {r for launched, _ in in_flight for r in launched.num_scheduled_tokens}
            assert held.isdisjoint(out.num_scheduled_tokens), "a request is in two steps at once"
            scheduler.in_flight.update(out.num_scheduled_tokens)
            in_flight.append((out, runner.execute(out)))
        most = max(most, len(in_flight))
        if in_flight:
            out, result = in_flight.pop(0)
            scheduler.in_flight.difference_update(out.num_scheduled_tokens)
            scheduler.update_from_output(out, result)
    raise AssertionError("the scheduler stopped making progress")


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12: preemptions, never of a request in flight
def test_two_steps_in_flight_hold_disjoint_requests_and_lose_no_token(num_blocks: int) -> None:
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16)
    requests = [make_request(str(i), prompt_len=6 + i, max_tokens=8) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    assert pipelined_run(scheduler, FakeRunner(), depth=2) == 2
    assert (scheduler.stats.num_preemptions > 0) == (num_blocks == 12)
    for request in requests:
        assert request.output_token_ids == list(range(100, 108))
        assert request.status == RequestStatus.FINISHED_LENGTH
    assert_no_block_leaked(scheduler)


def test_a_request_in_flight_is_neither_scheduled_nor_preempted() -> None:
    scheduler, runner, (a, b, c) = _three_requests_outgrowing_six_blocks("fcfs", [0, 0, 0])
    scheduler.in_flight.add("c")  # the latest arrival, the usual victim: its step has not come back
    out = scheduler.schedule()
    assert "c" not in out.num_scheduled_tokens and c.status == RequestStatus.RUNNING
    assert out.finished_req_ids == {"b"}  # the victim is the last request not in flight
    assert b.status == RequestStatus.PREEMPTED and a.req_id in out.num_scheduled_tokens
