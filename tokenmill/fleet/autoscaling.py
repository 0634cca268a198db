"""The fleet's autoscaling policy for Ray Serve: enough replicas for the larger of two demands.

- requests: ongoing (queued + running) requests over `target_ongoing_requests` per replica, Ray
  Serve's own rule;
- tokens: the replicas' reported queued and running tokens (prompt + max_tokens, from their
  `record_autoscaling_stats`) over `target_load_tokens` per replica, so that a few long requests
  count as much as many short ones.

Ray Serve applies min/max replicas and the upscale/downscale delays around it."""

from __future__ import annotations

from typing import Any


class TokenLoadPolicy:
    """A class-callable policy: Ray Serve builds it once with `policy_kwargs` and calls it each tick."""

    def __init__(self, target_load_tokens: int = 16384) -> None:
        if target_load_tokens <= 0:
            raise ValueError("target_load_tokens must be positive")
        self.target_load_tokens = target_load_tokens

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        """`ctx` is Ray Serve's AutoscalingContext; returns (desired replicas, policy state)."""
        if ctx.current_num_replicas == 0:
            return ctx.target_num_replicas, {}
        by_requests = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
        per_replica = (ctx.aggregated_metrics or {}).get("load_tokens", {})
        by_tokens = sum(per_replica.values()) / self.target_load_tokens
        return max(by_requests, by_tokens), {}
