"""A user request's RequestMetrics from its samples' core timings: the one merge, for the offline
LLM and the async engine alike."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.engine.messages import RequestTimings
from tokenmill.outputs import RequestMetrics


def merge_request_metrics(arrival_time: float, children: Sequence[RequestTimings]) -> RequestMetrics:
    """`children`: the timings of the request's samples that reached the engine, child 0 (the prefill
    leader, whose prompt lookup counts the cached tokens) first. Times are the earliest start and the
    latest finish over the samples; counts are summed."""
    scheduled = [c.first_scheduled_time for c in children if c.first_scheduled_time is not None]
    first_tokens = [c.first_token_time for c in children if c.first_token_time is not None]
    finished = [c.finished_time for c in children if c.finished_time is not None]
    return RequestMetrics(
        arrival_time=arrival_time,
        first_scheduled_time=min(scheduled, default=None),
        first_token_time=min(first_tokens, default=None),
        finished_time=max(finished, default=None),
        num_preemptions=sum(c.num_preemptions for c in children),
        num_cached_tokens=children[0].num_cached_tokens if children else 0,
        num_draft_tokens=sum(c.num_draft_tokens for c in children),
        num_accepted_tokens=sum(c.num_accepted_tokens for c in children),
    )
