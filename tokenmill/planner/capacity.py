"""The capacity formula and the cost of the fleet it plans.

    replicas = ceil(peak_rps x (avg_input + avg_output) / (tokens_per_s_per_replica x utilization) x redundancy)
               + spare

Tokens per second per replica is the total (prompt + output) rate, since the formula counts both. Spare
replicas (N+1) are added after rounding. Costs assume the planned fleet runs at the peak load around the clock.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

HOURS_PER_DAY = 24
HOURS_PER_MONTH = 720  # a 30-day month
# A raw figure this close to an integer is that integer: 55.00000000000001 (float error) must plan 55, not 56.
INTEGER_REL_TOL = 1e-9


@dataclass(frozen=True)
class PlanInputs:
    """What `plan` needs; every rate is per second, every token count a mean per request."""

    peak_rps: float
    avg_input_tokens: float
    avg_output_tokens: float
    tokens_per_s_per_replica: float  # total (prompt + output) tokens/s one replica sustains
    throughput_source: str = "--throughput"  # where tokens_per_s_per_replica came from, for the report
    utilization: float = 0.7  # the target fraction of a replica's throughput to use at peak, in (0, 1]
    redundancy: float = 1.0  # a multiplier >= 1 on the formula, before rounding
    spare: int = 0  # replicas added after rounding (1 for N+1)
    cost_per_hour: float | None = None  # $ per replica-hour; None: costs are unknown
    hardware: str | None = None
    ttft_slo_ms: float | None = None  # p99 SLOs: with a --profile they bound the throughput per replica
    tpot_slo_ms: float | None = None

    def __post_init__(self) -> None:
        require_positive("--peak-rps", self.peak_rps)
        require_positive("--input-tokens", self.avg_input_tokens)
        require_positive("--output-tokens", self.avg_output_tokens)
        require_positive("the throughput per replica (--throughput)", self.tokens_per_s_per_replica)
        if not 0 < self.utilization <= 1:
            raise ValueError(f"--utilization must be in (0, 1], got {self.utilization}: pass e.g. 0.7 for 70%.")
        if not self.redundancy >= 1:
            raise ValueError(f"--redundancy must be >= 1 (a multiplier, 1.0 = none), got {self.redundancy}.")
        if self.spare < 0:
            raise ValueError(f"--spare must be >= 0 (replicas added after rounding), got {self.spare}.")
        if self.cost_per_hour is not None and not self.cost_per_hour >= 0:
            raise ValueError(f"--cost-per-hour must be >= 0, got {self.cost_per_hour}.")
        for flag, slo in (("--ttft-slo-ms", self.ttft_slo_ms), ("--tpot-slo-ms", self.tpot_slo_ms)):
            if slo is not None:
                require_positive(flag, slo)


@dataclass(frozen=True)
class Costs:
    """The planned fleet's cost at peak load; $ figures."""

    cost_per_hour: float  # per replica
    per_million_output_tokens: float
    per_million_total_tokens: float
    per_day: float
    per_month: float  # 30 days


@dataclass(frozen=True)
class Plan:
    """The answer: how many replicas, how loaded each is at peak, and what the fleet costs."""

    inputs: PlanInputs
    replicas: int  # ceil(raw_replicas) + spare
    raw_replicas: float  # the formula before rounding and spare
    peak_tokens_per_s: float  # the whole fleet's (prompt + output) load at peak
    load_per_replica_tok_s: float  # spread over every replica, spares included
    utilization_at_peak: float  # load_per_replica_tok_s / tokens_per_s_per_replica
    costs: Costs | None  # None when no $/hour is known

    @property
    def headroom(self) -> float:
        """The fraction of each replica's throughput left unused at peak."""
        return 1.0 - self.utilization_at_peak

    def to_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "raw_replicas": self.raw_replicas,
            "tokens_per_s_per_replica": self.inputs.tokens_per_s_per_replica,
            "throughput_source": self.inputs.throughput_source,
            "peak_tokens_per_s": self.peak_tokens_per_s,
            "load_per_replica_tok_s": self.load_per_replica_tok_s,
            "utilization_at_peak": self.utilization_at_peak,
            "headroom": self.headroom,
            "costs": asdict(self.costs) if self.costs else None,
            "inputs": asdict(self.inputs),
        }


def plan(inputs: PlanInputs) -> Plan:
    """Size a fleet for `inputs`: replicas from the capacity formula, then load and cost at peak."""
    peak_tok_s = inputs.peak_rps * (inputs.avg_input_tokens + inputs.avg_output_tokens)
    raw = peak_tok_s / (inputs.tokens_per_s_per_replica * inputs.utilization) * inputs.redundancy
    replicas = ceil_tolerant(raw) + inputs.spare
    load = peak_tok_s / replicas
    return Plan(
        inputs=inputs,
        replicas=replicas,
        raw_replicas=raw,
        peak_tokens_per_s=peak_tok_s,
        load_per_replica_tok_s=load,
        utilization_at_peak=load / inputs.tokens_per_s_per_replica,
        costs=None if inputs.cost_per_hour is None else fleet_costs(inputs, replicas, inputs.cost_per_hour),
    )


def fleet_costs(inputs: PlanInputs, replicas: int, cost_per_hour: float) -> Costs:
    """What `replicas` replicas at `cost_per_hour` each cost, serving the peak load all the time."""
    fleet_per_s = replicas * cost_per_hour / 3600
    return Costs(
        cost_per_hour=cost_per_hour,
        per_million_output_tokens=fleet_per_s / (inputs.peak_rps * inputs.avg_output_tokens) * 1e6,
        per_million_total_tokens=fleet_per_s
        / (inputs.peak_rps * (inputs.avg_input_tokens + inputs.avg_output_tokens))
        * 1e6,
        per_day=replicas * cost_per_hour * HOURS_PER_DAY,
        per_month=replicas * cost_per_hour * HOURS_PER_MONTH,
    )


def ceil_tolerant(value: float) -> int:
    """ceil, except that a float a rounding error above an integer is that integer (at least 1)."""
    nearest = round(value)
    if math.isclose(value, nearest, rel_tol=INTEGER_REL_TOL):
        return max(1, nearest)
    return max(1, math.ceil(value))


def require_positive(flag: str, value: float) -> None:
    """ValueError unless `value` > 0 (NaN fails too), naming the flag that set it."""
    if not value > 0:
        raise ValueError(f"{flag} must be > 0, got {value}.")
