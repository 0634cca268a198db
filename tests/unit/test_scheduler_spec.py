"""The scheduler's side of speculative decoding, with hand-written runner outputs: drafts are scheduled
tokens of their request, cut to the budget, max_tokens and max_model_len; rejected ones roll back
num_computed_tokens; a stop inside an accepted run ends the request there. Block size 4."""

from __future__ import annotations

from tests.unit.test_scheduler import BS, EOS, make_request
from tokenmill.config import SchedulerConfig, SpeculativeConfig
from tokenmill.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.request import Request
from tokenmill.scheduling.scheduler import Scheduler


def spec_scheduler(
    k: int = 4, method: str = "ngram", num_blocks: int = 64, disable_by_batch_size: int = 4, **config: object
) -> Scheduler:
    spec = SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        model="draft" if method == "draft_model" else None,
        disable_by_batch_size=disable_by_batch_size,
    )
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, BS), spec)  # type: ignore[arg-type]


def prefill(scheduler: Scheduler, request: Request, first: int, drafts: list[int]) -> SchedulerOutput:
    """Run the request's prompt step: it samples `first` and the runner proposes `drafts`."""
    scheduler.add_request(request)
    out = scheduler.schedule()
    spec = {request.req_id: drafts} if drafts else {}
    scheduler.update_from_output(out, ModelRunnerOutput({request.req_id: [first]}, spec_token_ids=spec))
    return out


def test_drafts_are_scheduled_after_the_last_token_and_rejected_ones_roll_back() -> None:
    scheduler = spec_scheduler()
    request = make_request("a", prompt_len=8, max_tokens=20)
    prefill(scheduler, request, 50, [51, 52, 53])
    out = scheduler.schedule()
    assert out.scheduled_spec_tokens == {"a": [51, 52, 53]}
    assert out.num_scheduled_tokens == {"a": 4}  # the sampled token and three drafts
    # 51 kept, 52 rejected: the runner emits 51 and its own 60.
    outputs = scheduler.update_from_output(out, ModelRunnerOutput({"a": [51, 60]}))
    assert outputs[0].new_token_ids == [51, 60]
    assert request.output_token_ids == [50, 51, 60]
    assert request.num_computed_tokens == request.num_tokens - 1  # 53's and 52's slots are recomputed
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (3, 1)
    stats = scheduler.stats.spec
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.accepted_per_pos == [1, 0, 0]


def test_drafts_never_let_the_output_pass_max_tokens() -> None:
    """(Nor max_model_len: admission keeps prompt + max_tokens within it.)"""
    scheduler = spec_scheduler(max_model_len=64)
    request = make_request("a", prompt_len=8, max_tokens=3)
    prefill(scheduler, request, 50, [51, 52, 53, 54])
    out = scheduler.schedule()
    assert out.scheduled_spec_tokens == {"a": [51]}  # 1 output + 1 draft + the step's own token = 3
    scheduler.update_from_output(out, ModelRunnerOutput({"a": [51, 52]}))
    assert request.output_token_ids == [50, 51, 52] and request.is_finished


def test_a_stop_token_inside_the_accepted_run_ends_the_request_there() -> None:
    scheduler = spec_scheduler()
    request = make_request("a", prompt_len=8, max_tokens=20)
    prefill(scheduler, request, 50, [51, EOS, 53])
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, ModelRunnerOutput({"a": [51, EOS, 53, 70]}))
    assert outputs[0].new_token_ids == [51, EOS] and outputs[0].finish_reason == "stop"
    assert request.output_token_ids == [50, 51, EOS]
    assert not scheduler.has_unfinished() and scheduler.kv_cache.pool.num_free_blocks == 64


def test_the_budget_cuts_drafts_first() -> None:
    scheduler = spec_scheduler(max_num_batched_tokens=3)
    request = make_request("a", prompt_len=3, max_tokens=20)
    prefill(scheduler, request, 50, [51, 52, 53, 54])
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 3} and out.scheduled_spec_tokens == {"a": [51, 52]}


def test_no_drafts_above_disable_by_batch_size_running_requests() -> None:
    scheduler = spec_scheduler(disable_by_batch_size=1)
    a, b = make_request("a", max_tokens=20), make_request("b", max_tokens=20)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput({"a": [50], "b": [50]}, spec_token_ids={"a": [51], "b": [51]}))
    out = scheduler.schedule()
    assert out.scheduled_spec_tokens == {} and out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_a_draft_model_gets_lookahead_slots_that_are_never_cached_before_they_are_computed() -> None:
    scheduler = spec_scheduler(k=4, method="draft_model")
    request = make_request("a", prompt_len=8, max_tokens=20)
    scheduler.add_request(request)
    scheduler.schedule()
    # 8 prompt tokens + 4 lookahead slots: 3 blocks, of which the 2 full prompt blocks are cached.
    assert len(scheduler.kv_cache.req_blocks["a"]) == 3
    assert scheduler.kv_cache.pool.num_free_blocks == 61


def test_drafts_are_dropped_rather_than_preempting_anyone() -> None:
    scheduler = spec_scheduler(num_blocks=4)
    a = make_request("a", prompt_len=7, max_tokens=8)
    b = make_request("b", prompt_len=7, max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()  # 2 blocks each: the pool is full
    scheduler.update_from_output(
        out, ModelRunnerOutput({"a": [50], "b": [50]}, spec_token_ids={"a": [51, 52], "b": [51, 52]})
    )
    out = scheduler.schedule()  # each has 8 tokens in 2 full blocks: a draft would need a third
    assert out.scheduled_spec_tokens == {}
    assert scheduler.stats.num_preemptions == 0 and out.num_scheduled_tokens == {"a": 1, "b": 1}
