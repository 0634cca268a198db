"""The planner and the prefix cache: a workload's cached prompt share is never computed (the KV cache's own
blocks cost nothing, a second tier's cost their load time), so a replica sustains more and answers sooner."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from tests.unit.test_planner_latency import _profile_file, costs
from tokenmill.planner.simulate import simulate
from tokenmill.planner.sources import PlanRequest, resolve_all


def test_the_cached_share_of_a_prompt_is_not_computed() -> None:
    # 10-token prompt, half cached: one step of 1 s + 5 tokens x 0.1 s -> first token at 1.5 s (2 s uncached).
    cached = dataclasses.replace(costs(), cached_prompt_share=0.5)
    assert simulate(cached, [(10, 1)], math.inf).ttft_p50_ms == pytest.approx(1500)
    assert simulate(costs(), [(10, 1)], math.inf).ttft_p50_ms == pytest.approx(2000)


def test_loading_cached_tokens_from_a_tier_costs_its_time() -> None:
    tier = dataclasses.replace(costs(), cached_prompt_share=0.5, cached_load_per_token_s=0.02)
    assert simulate(tier, [(10, 1)], math.inf).ttft_p50_ms == pytest.approx(1600)  # + 5 x 20 ms


def test_the_last_prompt_token_is_always_computed() -> None:
    almost_all = dataclasses.replace(costs(), cached_prompt_share=0.99)
    assert simulate(almost_all, [(10, 1)], math.inf).ttft_p50_ms == pytest.approx(1100)  # 9 cached, 1 computed


def test_a_cached_share_raises_the_planned_throughput_per_replica(tmp_path: Path) -> None:
    profile = str(_profile_file(tmp_path))
    base = resolve_all(PlanRequest(peak_rps=20, profile=profile, ttft_slo_ms=500))
    cached = resolve_all(PlanRequest(peak_rps=20, profile=profile, ttft_slo_ms=500, cached_prompt_share=0.8))
    assert cached.inputs.tokens_per_s_per_replica > 1.2 * base.inputs.tokens_per_s_per_replica
    unchanged = resolve_all(PlanRequest(peak_rps=20, profile=profile, ttft_slo_ms=500, cached_prompt_share=0.0))
    assert unchanged.inputs.tokens_per_s_per_replica == base.inputs.tokens_per_s_per_replica


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"cached_prompt_share": 1.0, "profile": True}, "share in \\[0, 1\\)"),
        ({"cached_load_us": -1.0, "profile": True}, "--cached-load-us >= 0"),
        ({"cached_prompt_share": 0.5, "throughput": 100.0, "input_tokens": 10, "output_tokens": 10}, "need --profile"),
    ],
)
def test_bad_cache_flags_are_clear_errors(tmp_path: Path, request_fields: dict[str, object], message: str) -> None:
    fields = dict(request_fields)
    if fields.pop("profile", False):
        fields["profile"] = str(_profile_file(tmp_path))
    with pytest.raises(ValueError, match=message):
        resolve_all(PlanRequest(peak_rps=1, **fields))  # type: ignore[arg-type]
