"""The scheduler under async scheduling, driven by the engine's overlapped loop with a fake runner.

The runner computes a step when it is launched (it appends the token it samples, as a device would hold
it); the scheduler learns the step's output one step later, after it has scheduled the next one. The
fake samples 100 + i as a request's i-th output, so an output of 100, 101, ... lost and repeated nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.unit.test_scheduler import EOS, FakeRunner, assert_no_block_leaked, counting, make_request, make_scheduler
from tokenmill.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduling.request import Request, RequestStatus
from tokenmill.scheduling.scheduler import Scheduler


def overlapped_run(
    scheduler: Scheduler,
    runner: FakeRunner,
    max_steps: int = 1000,
    between: Callable[[int], None] | None = None,
    scheduled: Callable[[SchedulerOutput], None] | None = None,
) -> tuple[dict[str, list[int]], int]:
    """EngineCore._step_async's loop: schedule and launch the next step, then collect the oldest while
    another is in flight (or when nothing was launched). `between(i)` runs before the i-th schedule,
    `scheduled(out)` after each.
    Returns each request's emitted tokens and the number of steps launched while another was in flight."""
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    emitted: dict[str, list[int]] = {}
    overlapped = 0
    for i in range(max_steps):
        if not scheduler.has_unfinished() and not in_flight:
            return emitted, overlapped
        if between is not None:
            between(i)
        out = scheduler.schedule()
        if scheduled is not None:
            scheduled(out)
        if out.is_empty:
            scheduler.not_launched(out)
        else:
            overlapped += bool(in_flight)
            in_flight.append((out, runner.execute(out)))
        if in_flight and (len(in_flight) > 1 or out.is_empty):
            done, result = in_flight.pop(0)
            outputs: list[EngineCoreOutput] = scheduler.update_from_output(done, result)
            for output in outputs:
                emitted.setdefault(output.req_id, []).extend(output.new_token_ids)
    raise AssertionError("the scheduler stopped making progress")


def async_scheduler(num_blocks: int = 64, **config: object) -> Scheduler:
    return make_scheduler(num_blocks, async_scheduling=True, **config)


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12: preemptions of requests whose tokens are in flight
def test_overlapped_steps_lose_and_repeat_no_token(num_blocks: int) -> None:
    scheduler = async_scheduler(num_blocks, max_num_batched_tokens=16)
    requests = [make_request(str(i), prompt_len=6 + i, max_tokens=8) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    emitted, overlapped = overlapped_run(scheduler, FakeRunner())
    assert overlapped >= 8  # at least one per output token past the first
    assert (scheduler.stats.num_preemptions > 0) == (num_blocks == 12)
    for request in requests:
        assert request.output_token_ids == emitted[request.req_id] == list(range(100, 108))
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.num_output_placeholders == request.num_stale_outputs == 0
    assert_no_block_leaked(scheduler)


def test_a_request_is_scheduled_again_while_its_last_token_is_in_flight() -> None:
    scheduler = async_scheduler()
    request = make_request("a", prompt_len=6, max_tokens=4)
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 6}
    assert (request.num_computed_tokens, request.num_output_placeholders) == (6, 1)
    second = scheduler.schedule()  # the first step's output is not in: its token is a placeholder
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.cached_requests[0].num_computed_tokens == 6
    assert (request.num_computed_tokens, request.num_output_placeholders) == (7, 2)
    runner = FakeRunner()
    scheduler.update_from_output(first, runner.execute(first))
    assert request.output_token_ids == [100] and request.num_output_placeholders == 1


def test_no_step_is_scheduled_past_max_tokens() -> None:
    """The step sampling the max_tokens-th token is the request's last, even before its output is in."""
    scheduler = async_scheduler()
    request = make_request("a", prompt_len=4, max_tokens=3)
    scheduler.add_request(request)
    runner = FakeRunner()
    launched = []
    for _ in range(3):
        out = scheduler.schedule()
        launched.append(out.num_scheduled_tokens)
        runner.execute(out)
    assert launched == [{"a": 4}, {"a": 1}, {"a": 1}]
    assert scheduler.schedule().is_empty  # three tokens in flight: max_tokens


def test_a_stop_token_ends_the_request_and_the_step_in_flight_adds_nothing() -> None:
    scheduler = async_scheduler()
    requests = [make_request(name, prompt_len=5, max_tokens=8) for name in "ab"]
    for request in requests:
        scheduler.add_request(request)
    # Request a's third output is EOS; b's are plain counting (the fake samples by output index only).
    runner = FakeRunner(sample=lambda i: EOS if i == 2 else counting(i))
    requests[1].sampling_params.ignore_eos = True
    emitted, _ = overlapped_run(scheduler, runner)
    assert emitted["a"] == [100, 101, EOS] and requests[0].status == RequestStatus.FINISHED_STOPPED
    assert emitted["b"] == [100, 101, EOS, 103, 104, 105, 106, 107]
    assert_no_block_leaked(scheduler)


def test_a_request_aborted_with_two_steps_in_flight_gets_nothing_more() -> None:
    scheduler = async_scheduler()
    a, b = make_request("a", prompt_len=4, max_tokens=10), make_request("b", prompt_len=4, max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)

    def abort_a(i: int) -> None:
        if i == 4:
            scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)

    emitted, _ = overlapped_run(scheduler, FakeRunner(), between=abort_a)
    assert emitted["a"] == list(range(100, 103))  # steps 1-3 came back before the abort
    assert emitted["b"] == list(range(100, 110))
    assert_no_block_leaked(scheduler)


def test_tokens_sampled_for_a_preempted_request_in_flight_are_dropped() -> None:
    scheduler = async_scheduler(num_blocks=6, max_num_seqs=3)
    requests = [make_request(name, prompt_len=4, max_tokens=8, arrival=float(i)) for i, name in enumerate("abc")]
    for request in requests:
        scheduler.add_request(request)
    stale_seen = []

    def watch(_: SchedulerOutput) -> None:
        stale_seen.append(max(r.num_stale_outputs for r in requests))

    emitted, _ = overlapped_run(scheduler, FakeRunner(), scheduled=watch)
    assert scheduler.stats.num_preemptions >= 1 and max(stale_seen) >= 1
    for request in requests:
        assert emitted[request.req_id] == request.output_token_ids == list(range(100, 108))
    assert_no_block_leaked(scheduler)


def test_requests_whose_sampling_reads_their_tokens_are_counted_while_live() -> None:
    scheduler = async_scheduler()
    plain = make_request("plain")
    penalized = make_request("penalized", presence_penalty=0.5)
    waiting: Request = make_request("waiting", repetition_penalty=1.2)
    for request in (plain, penalized, waiting):
        scheduler.add_request(request)
    assert scheduler.num_sync_requests == 2
    scheduler.finish_request("waiting", RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_sync_requests == 1
    overlapped_run(scheduler, FakeRunner())
    assert scheduler.num_sync_requests == 0
