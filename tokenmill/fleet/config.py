"""The fleet's own settings: how many replicas (fixed or autoscaled), each one's CPU share, and the
router's load slack. Plain Python: `tokenmill serve --help` never imports Ray."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FleetConfig:
    num_replicas: int = 1  # without autoscaling
    min_replicas: int | None = None  # set both min and max to autoscale between them
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0  # per replica, queued + running, for the autoscaler
    target_load_tokens: int = 16384  # per replica, queued + running prompt + max_tokens, for the autoscaler
    cpus_per_replica: float = 1.0  # Ray's num_cpus for each replica; its torch threads too
    prefix_router: bool = True  # False: Ray Serve's default router (power of two choices), to compare
    slack_tokens: int = 4096  # prefix affinity wins while its replica is within this many tokens of the least loaded
    max_ongoing_requests: int = 64  # per replica, before Ray Serve routes elsewhere or queues at the router
    max_attempts: int = 3  # sends of one request, when replicas fail before any output
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 30.0
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    routing_stats_period_s: float = 2.0
    prefill_replicas: int = 0  # > 0: that many prefill replicas before the decode ones (P/D disaggregation)
    pd_min_prompt_tokens: int = 512  # shorter prompts (estimated) skip the prefill hop
    ray_address: str | None = (
        None  # the Ray cluster to join ("auto": the one on this node); None: RAY_ADDRESS or a new one
    )

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both the minimum and the maximum number of replicas (--autoscale MIN:MAX)")
        if self.autoscale and not 1 <= self.min_replicas <= self.max_replicas:  # type: ignore[operator]
            raise ValueError("--autoscale MIN:MAX needs 1 <= MIN <= MAX")
        if not self.target_ongoing_requests > 0 or self.target_load_tokens < 1:
            raise ValueError("--target-ongoing-requests and target_load_tokens must be positive")
        if not self.cpus_per_replica > 0:
            raise ValueError("cpus_per_replica must be positive")
        if self.slack_tokens < 0 or self.max_attempts < 1 or self.max_ongoing_requests < 1:
            raise ValueError("slack_tokens must be >= 0, max_attempts and max_ongoing_requests >= 1")
        if self.prefill_replicas < 0 or self.pd_min_prompt_tokens < 0:
            raise ValueError("--prefill-replicas and --pd-min-prompt-tokens must not be negative")

    @property
    def disaggregated(self) -> bool:
        """Prefill replicas compute long prompts, decode replicas (the others) generate."""
        return self.prefill_replicas > 0

    @property
    def autoscale(self) -> bool:
        return self.min_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas."""
        if self.min_replicas is not None and self.max_replicas is not None:
            return self.min_replicas, self.max_replicas
        return self.num_replicas, self.num_replicas

    @property
    def num_threads(self) -> int:
        return max(1, int(self.cpus_per_replica))


def parse_autoscale(value: str) -> tuple[int, int]:
    """'MIN:MAX' -> (MIN, MAX)."""
    low, sep, high = value.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"--autoscale takes MIN:MAX, e.g. 1:4 (got {value!r})")
    return int(low), int(high)
