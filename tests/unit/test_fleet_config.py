"""The fleet's settings and its autoscaling policy, without Ray: flag parsing and validation, and the
replica count the policy asks for."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from tokenmill.fleet.autoscaling import TokenLoadPolicy
from tokenmill.fleet.config import FleetConfig, parse_autoscale
from tokenmill.fleet.flags import add_fleet_flags, fleet_config


def test_autoscale_takes_min_colon_max() -> None:
    assert parse_autoscale("1:4") == (1, 4)
    with pytest.raises(ValueError, match="MIN:MAX"):
        parse_autoscale("4")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_replicas": 0}, "--replicas"),
        ({"min_replicas": 1}, "both"),
        ({"min_replicas": 3, "max_replicas": 2}, "1 <= MIN <= MAX"),
        ({"target_ongoing_requests": 0}, "--target-ongoing-requests"),
        ({"prefill_replicas": -1}, "--prefill-replicas"),
    ],
)
def test_bad_settings_are_refused_with_the_flag_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetConfig(**kwargs)


def test_bounds_are_the_fixed_count_or_the_autoscale_range() -> None:
    assert FleetConfig(num_replicas=3).bounds == (3, 3)
    assert FleetConfig(min_replicas=1, max_replicas=4).bounds == (1, 4)


def context(replicas: int, requests: float, load_tokens: list[float], target_requests: float = 4) -> SimpleNamespace:
    config = SimpleNamespace(get_target_ongoing_requests=lambda: target_requests)
    metrics = {"load_tokens": {f"r{i}": t for i, t in enumerate(load_tokens)}}
    return SimpleNamespace(
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        total_num_requests=requests,
        aggregated_metrics=metrics,
        config=config,
    )


def test_policy_follows_requests_when_they_are_the_larger_demand() -> None:
    desired, _ = TokenLoadPolicy(target_load_tokens=10_000)(context(1, requests=12, load_tokens=[1000]))
    assert desired == 3


def test_policy_follows_tokens_when_a_few_requests_carry_many() -> None:
    desired, _ = TokenLoadPolicy(target_load_tokens=1000)(context(2, requests=2, load_tokens=[2500, 2500]))
    assert desired == 5


def test_policy_keeps_the_target_while_no_replica_runs() -> None:
    ctx = context(0, requests=0, load_tokens=[])
    ctx.target_num_replicas = 1
    assert TokenLoadPolicy()(ctx)[0] == 1


def test_a_single_server_reports_a_fleet_of_one() -> None:
    from tokenmill.metrics.prometheus import ServerMetrics

    text = ServerMetrics("m").render().decode()
    for state in ("current", "target", "min", "max"):
        assert f'tokenmill:fleet_replicas{{model_name="m",state="{state}"}} 1.0' in text


def test_fleet_flags_make_the_fleet_config() -> None:
    parser = argparse.ArgumentParser()
    add_fleet_flags(parser)
    args = parser.parse_args(["--autoscale", "1:3", "--cpus-per-replica", "2", "--fleet-router", "ray-default"])
    assert fleet_config(args) == FleetConfig(min_replicas=1, max_replicas=3, cpus_per_replica=2.0, prefix_router=False)
    assert fleet_config(parser.parse_args(["--replicas", "2"])) == FleetConfig(num_replicas=2)
    joined = fleet_config(parser.parse_args(["--replicas", "2", "--ray-address", "auto"]))
    assert joined == FleetConfig(num_replicas=2, ray_address="auto")


def test_prefill_replicas_make_a_disaggregated_fleet() -> None:
    parser = argparse.ArgumentParser()
    add_fleet_flags(parser)
    pd = fleet_config(parser.parse_args(["--prefill-replicas", "1", "--pd-min-prompt-tokens", "64"]))
    assert pd == FleetConfig(prefill_replicas=1, pd_min_prompt_tokens=64) and pd.disaggregated
    assert not fleet_config(parser.parse_args(["--replicas", "2"])).disaggregated


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({}, "give --kv-offloading-size"),
        ({"kv_offloading_size": 1.0, "kv_role": "decode"}, "drop --kv-role"),
        ({"kv_offloading_size": 1.0, "device": "cuda"}, "runs on CPUs"),
    ],
)
def test_a_disaggregated_fleet_needs_the_file_tier(overrides: dict[str, object], message: str) -> None:
    from tokenmill.config import EngineArgs
    from tokenmill.fleet.app import check_disaggregation

    with pytest.raises(ValueError, match=message):
        check_disaggregation(EngineArgs(model="m", **overrides))  # type: ignore[arg-type]
    check_disaggregation(EngineArgs(model="m", kv_offloading_size=1.0))
