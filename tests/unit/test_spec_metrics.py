"""Speculative decoding's counts on their way out: the engine's cumulative counters in each step
snapshot (across the process pipe too), exported to Prometheus as counters under vLLM's names, and
each request's draft / accepted tokens in its RequestMetrics and the server's `usage`."""

from __future__ import annotations

import dataclasses

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.messages import EVENTS, EngineSnapshot, EngineStep, NewRequest, RequestTimings
from tokenmill.engine.request_metrics import merge_request_metrics
from tokenmill.metrics.prometheus import ServerMetrics
from tokenmill.outputs import EngineCoreOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.request import Request
from tokenmill.server.protocol import SpeculativeDecodingUsage, UsageInfo

MODEL = "tiny"


def _snapshot(drafts: int, draft_tokens: int, accepted: int, per_pos: tuple[int, ...]) -> EngineSnapshot:
    base = EngineSnapshot(1, 0, 0, 0.5, 10, 0, 0, 0, 4, 1)
    return dataclasses.replace(
        base,
        spec_num_drafts=drafts,
        spec_num_draft_tokens=draft_tokens,
        spec_num_accepted_tokens=accepted,
        spec_accepted_per_pos=per_pos,
    )


def _value(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"tokenmill:{name}_total", {"model_name": MODEL, **labels})


def _per_pos(metrics: ServerMetrics, position: int) -> float | None:
    return _value(metrics, "spec_decode_num_accepted_tokens_per_pos", position=str(position))


# ---------------------------------------------------------------------- Prometheus
def test_counters_have_vllms_names_and_follow_the_cumulative_snapshots() -> None:
    metrics = ServerMetrics(MODEL)
    # Two steps: 2 drafts of 4 (accepted 3 and 2), then 3 more of 4 (accepted 4, 1, 0).
    metrics.on_step(_snapshot(2, 8, 5, (2, 2, 1)))
    metrics.on_step(_snapshot(5, 20, 10, (4, 3, 2, 1)))
    assert _value(metrics, "spec_decode_num_drafts") == 5
    assert _value(metrics, "spec_decode_num_draft_tokens") == 20
    assert _value(metrics, "spec_decode_num_accepted_tokens") == 10
    assert [_per_pos(metrics, i) for i in range(4)] == [4, 3, 2, 1]


def test_a_step_without_new_drafts_adds_nothing() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_snapshot(2, 8, 5, (2, 2, 1)))
    metrics.on_step(_snapshot(2, 8, 5, (2, 2, 1)))
    assert _value(metrics, "spec_decode_num_draft_tokens") == 8
    assert _per_pos(metrics, 0) == 2


def test_counts_go_on_from_where_they_were_after_an_engine_restart() -> None:
    # A new engine's cumulative counts start again from 0; the exported counters must not drop.
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_snapshot(5, 20, 10, (4, 3, 2, 1)))
    metrics.on_restart()
    metrics.on_step(_snapshot(1, 4, 2, (1, 1)))
    assert _value(metrics, "spec_decode_num_drafts") == 6
    assert _value(metrics, "spec_decode_num_draft_tokens") == 24
    assert _value(metrics, "spec_decode_num_accepted_tokens") == 12
    assert [_per_pos(metrics, i) for i in range(4)] == [5, 4, 2, 1]


def test_without_speculation_the_counters_stay_at_zero_and_no_position_appears() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_snapshot(0, 0, 0, ()))
    assert _value(metrics, "spec_decode_num_drafts") == 0
    assert _value(metrics, "spec_decode_num_draft_tokens") == 0
    assert _per_pos(metrics, 0) is None
    assert b"tokenmill:spec_decode_num_accepted_tokens_total" in metrics.render()


# ---------------------------------------------------------------------- across the engine-process pipe
def test_the_spec_counts_cross_the_pipe() -> None:
    snapshot = _snapshot(5, 20, 10, (4, 3, 2, 1))
    timings = RequestTimings(1.0, 2.0, 3.0, 0, 16, num_draft_tokens=12, num_accepted_tokens=7)
    step = EngineStep([EngineCoreOutput("a", [5])], snapshot, {"a": timings})
    decoded = EVENTS.decode(EVENTS.encode(step))
    assert isinstance(decoded, EngineStep)
    assert decoded.snapshot == snapshot  # the per-position list comes back as the snapshot's tuple
    assert decoded.timings["a"] == timings


def test_timings_carry_a_requests_draft_counts() -> None:
    request = _request("a")
    request.num_draft_tokens, request.num_accepted_tokens = 12, 7
    timings = RequestTimings.of(request)
    assert (timings.num_draft_tokens, timings.num_accepted_tokens) == (12, 7)


# ---------------------------------------------------------------------- per request
def _request(req_id: str, drafts: int = 0, accepted: int = 0) -> Request:
    request = Request(req_id, [1, 2, 3], SamplingParams(max_tokens=4))
    request.num_draft_tokens, request.num_accepted_tokens = drafts, accepted
    return request


def test_llm_metrics_sum_the_draft_counts_of_a_requests_samples() -> None:
    samples = [_request("r#0", 8, 5), _request("r#1", 4, 1)]  # n=2
    metrics = merge_request_metrics(0.0, [RequestTimings.of(r) for r in samples])
    assert (metrics.num_draft_tokens, metrics.num_accepted_tokens) == (12, 6)


def test_async_engine_metrics_sum_the_draft_counts_of_a_requests_samples() -> None:
    samples = [_request("r#0", 8, 5), _request("r#1", 4, 1)]
    stream = RequestStream("r", [NewRequest.of(r) for r in samples], 3, 0.0)
    stream.timings = {r.req_id: RequestTimings.of(r) for r in samples}  # as the engine sent them
    metrics = stream.metrics()
    assert (metrics.num_draft_tokens, metrics.num_accepted_tokens) == (12, 6)


# ---------------------------------------------------------------------- usage in responses
def test_usage_without_speculation_has_exactly_openais_fields() -> None:
    usage = UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    assert usage.model_dump() == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_usage_with_speculation_reports_draft_and_accepted_tokens() -> None:
    spec = SpeculativeDecodingUsage(num_draft_tokens=12, num_accepted_tokens=6)
    usage = UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7, speculative_decoding=spec)
    assert usage.model_dump()["speculative_decoding"] == {"num_draft_tokens": 12, "num_accepted_tokens": 6}


def test_the_response_schema_still_describes_usage_and_its_speculative_part() -> None:
    # /openapi.json documents responses in serialization mode: the serializer that leaves out an
    # absent speculative_decoding must not hide UsageInfo's fields there.
    schema = UsageInfo.model_json_schema(mode="serialization")
    assert {"prompt_tokens", "completion_tokens", "total_tokens", "speculative_decoding"} <= set(schema["properties"])
