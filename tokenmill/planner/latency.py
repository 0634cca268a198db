"""The latency side of a plan: what one replica sustains within the SLOs, and its latencies at a given load.

Every figure comes from `simulate` over a calibrated step-time model (`tokenmill bench calibrate`). The
workload is the calibration's (prompt, output) lengths, repeated to at least `MIN_REQUESTS` so a run's start
and tail do not dominate, or a fixed mean when the user overrides the means.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.planner.simulate import SimResult, simulate
from tokenmill.planner.step_model import Profile, StepCosts

MIN_REQUESTS = 400
BISECTION_STEPS = 20


@dataclass(frozen=True)
class LatencyPlan:
    """One replica's limits from the model, and its predicted latencies at the planned load."""

    saturation: SimResult  # all requests at once: the most the replica serves
    at_slo: SimResult | None  # the highest Poisson rate whose p99s meet every SLO given (None: no SLO given)
    at_peak: SimResult | None  # at the planned per-replica request rate (None: not computed)
    slo_met: bool  # whether some rate meets the SLOs at all

    @property
    def sustained(self) -> SimResult:
        """What the capacity formula should use: the SLO-bounded figure when SLOs are given."""
        return self.at_slo if self.at_slo is not None else self.saturation

    def to_dict(self) -> dict[str, Any]:
        return {
            "saturation": asdict(self.saturation),
            "at_slo": asdict(self.at_slo) if self.at_slo else None,
            "at_peak": asdict(self.at_peak) if self.at_peak else None,
            "slo_met": self.slo_met,
        }


def workload_lengths(
    profile: Profile, input_tokens: float | None, output_tokens: float | None
) -> list[tuple[int, int]]:
    """The calibration's lengths, or every request at the given means where the user overrides them."""
    lengths = profile.lengths
    if input_tokens is not None or output_tokens is not None:
        prompt = round(input_tokens) if input_tokens is not None else round(profile.avg_input_tokens)
        output = round(output_tokens) if output_tokens is not None else round(profile.avg_output_tokens)
        lengths = [(max(1, prompt), max(1, output))]
    return lengths * math.ceil(MIN_REQUESTS / len(lengths))


def meets(result: SimResult, ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> bool:
    return (ttft_slo_ms is None or result.ttft_p99_ms <= ttft_slo_ms) and (
        tpot_slo_ms is None or result.tpot_p99_ms <= tpot_slo_ms
    )


def saturation_rate(costs: StepCosts, lengths: list[tuple[int, int]]) -> tuple[SimResult, float]:
    """(the all-at-once run, the request rate it sustains)."""
    sat = simulate(costs, lengths, math.inf)
    mean_tokens = sum(p + o for p, o in lengths) / len(lengths)
    return sat, sat.total_tok_s / mean_tokens


def plan_latency(
    costs: StepCosts,
    lengths: list[tuple[int, int]],
    ttft_slo_ms: float | None,
    tpot_slo_ms: float | None,
    peak_rate_per_replica: float | None = None,
) -> LatencyPlan:
    """Saturation, the highest rate within the SLOs (bisection on the Poisson rate), and the peak load's figures."""
    sat, sat_rate = saturation_rate(costs, lengths)
    at_slo: SimResult | None = None
    slo_met = True
    if ttft_slo_ms is not None or tpot_slo_ms is not None:
        low, high = 0.0, sat_rate
        for _ in range(BISECTION_STEPS):
            mid = (low + high) / 2
            result = simulate(costs, lengths, mid)
            if meets(result, ttft_slo_ms, tpot_slo_ms):
                low, at_slo = mid, result
            else:
                high = mid
        slo_met = at_slo is not None
        if at_slo is None:  # not even the lowest rate tried: report the light-load figures
            at_slo = simulate(costs, lengths, sat_rate / 2**BISECTION_STEPS)
    at_peak = None
    if peak_rate_per_replica is not None:
        at_peak = simulate(costs, lengths, peak_rate_per_replica)  # above saturation: its queue shows
    return LatencyPlan(sat, at_slo, at_peak, slo_met)


def curve(costs: StepCosts, lengths: list[tuple[int, int]], points: int = 12) -> list[SimResult]:
    """Results at evenly spaced fractions of the saturation rate, for a throughput-latency plot."""
    _, sat_rate = saturation_rate(costs, lengths)
    return [simulate(costs, lengths, sat_rate * (i + 1) / points) for i in range(points)]
