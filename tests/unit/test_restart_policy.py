"""The engine restart policy: doubling back-off per death, and a cap on deaths per window."""

from __future__ import annotations

from tokenmill.engine.messages import NewRequest, build_requests
from tokenmill.engine.restart_policy import RestartPolicy
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.request import Request


def test_deaths_are_capped_per_window() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=60.0)
    assert policy.allow(0.0) and policy.allow(10.0)
    assert not policy.allow(20.0)  # a third death within the window: stay dead
    assert policy.allow(71.0)  # the first has left the window


def test_zero_turns_restarts_off_and_back_off_doubles() -> None:
    assert not RestartPolicy(max_restarts=0).allow(0.0)
    assert RestartPolicy(attempts=3, first_delay_s=0.5).delays() == [0.5, 1.0, 2.0]


def test_a_new_engine_builds_fresh_requests_from_what_the_front_end_sent() -> None:
    params = SamplingParams(max_tokens=4)
    leader = Request("r#0", [1, 2, 3], params, cache_salt="s")
    follower = Request("r#1", [1, 2, 3], params, prefill_leader=leader, cache_salt="s")
    sent = [NewRequest.of(leader), NewRequest.of(follower)]
    leader.num_computed_tokens, leader.output_token_ids, leader.num_preemptions = 3, [7], 1  # the dead engine's state
    built = build_requests(sent)
    assert [c.req_id for c in built] == ["r#0", "r#1"]
    assert built[0].num_computed_tokens == 0 and built[0].output_token_ids == [] and built[0].num_preemptions == 0
    assert built[1].prefill_leader is built[0]  # the link points into the new requests
    assert built[0].arrival_time == leader.arrival_time and built[1].cache_salt == "s"
