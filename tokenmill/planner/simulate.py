"""Replay a workload through a model of tokenmill's scheduler to predict throughput and latency at a load.

Each step the running requests that finished their prompts decode one token each; the token budget left
(max_num_batched_tokens) goes to prompt chunks, first to prompts already started, then to waiting requests in
arrival order, up to max_num_seqs requests in flight (the scheduler's rules: running before waiting, chunked
prefill). A step lasts what `StepCosts` says. A request's first token comes at the end of the step that
finishes its prompt; each later token at the end of a decode step. The KV cache is assumed large enough
(no preemption): plan the cache so that holds. A prompt's cached share (StepCosts.cached_prompt_share) is
never computed: its first chunk starts after it, and the step that admits it also reads it back
(cached_load_per_token_s each).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tokenmill.planner.step_model import StepCosts


@dataclass
class _Flight:
    arrival: float
    prompt: int
    output: int
    prefilled: int = 0
    generated: int = 0
    first_token_at: float = 0.0


@dataclass(frozen=True)
class SimResult:
    """Figures as `tokenmill bench serve` reports them (TPOT per request; percentiles across requests)."""

    request_rate: float  # offered requests/s (inf: all at once)
    duration_s: float  # the run's start (time 0) to its last token
    output_tok_s: float
    total_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    mean_batch: float  # decode rows per step, averaged over steps


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Poisson arrival times of `n` requests at `rate`/s (all at 0 when the rate is inf)."""
    if math.isinf(rate):
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0, got {rate}.")
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def simulate(
    costs: StepCosts,
    lengths: list[tuple[int, int]],
    rate: float,
    seed: int = 0,
    arrival_times: list[float] | None = None,
) -> SimResult:
    """Serve `lengths` ((prompt, output) per request) arriving at `rate`/s (or at `arrival_times`, seconds
    from the run's start, when given); see the module docstring. The run lasts from 0 to its last token,
    as `tokenmill bench serve` times it."""
    if not lengths:
        raise ValueError("the workload has no requests.")
    times = arrival_times if arrival_times is not None else arrivals(len(lengths), rate, seed)
    if len(times) != len(lengths):
        raise ValueError(f"{len(times)} arrival times for {len(lengths)} requests.")
    pending = [_Flight(t, p, o) for t, (p, o) in zip(times, lengths)]
    pending.reverse()  # pop() takes the earliest
    waiting: list[_Flight] = []
    running: list[_Flight] = []  # admitted, in admission order
    done: list[_Flight] = []
    ttft: list[float] = []
    tpot: list[float] = []
    clock, steps, rows_total = 0.0, 0, 0
    while pending or waiting or running:
        while pending and pending[-1].arrival <= clock:
            waiting.append(pending.pop())
        if not waiting and not running:
            clock = pending[-1].arrival
            continue
        budget = costs.max_num_batched_tokens
        decoding = [f for f in running if f.prefilled == f.prompt]
        budget -= len(decoding)
        chunks: list[tuple[_Flight, int]] = []
        for flight in [f for f in running if f.prefilled < f.prompt]:
            if budget <= 0:
                break
            chunks.append((flight, min(budget, flight.prompt - flight.prefilled)))
            budget -= chunks[-1][1]
        load_s = 0.0
        while waiting and budget > 0 and len(running) < costs.max_num_seqs:
            flight = waiting.pop(0)
            running.append(flight)
            flight.prefilled = costs.cached_tokens(flight.prompt)
            load_s += flight.prefilled * costs.cached_load_per_token_s
            chunks.append((flight, min(budget, flight.prompt - flight.prefilled)))
            budget -= chunks[-1][1]
        clock += costs.step_seconds(len(decoding), sum(n for _, n in chunks)) + load_s
        steps += 1
        rows_total += len(decoding)
        for flight in decoding:
            flight.generated += 1
        for flight, n in chunks:
            flight.prefilled += n
            if flight.prefilled == flight.prompt:  # the prompt's last chunk samples the first token
                flight.generated, flight.first_token_at = 1, clock
                ttft.append(clock - flight.arrival)
        for flight in [f for f in running if f.generated >= f.output]:
            running.remove(flight)
            done.append(flight)
            if flight.output > 1:
                tpot.append((clock - flight.first_token_at) / (flight.output - 1))
    duration = clock
    out_tokens = sum(f.output for f in done)
    all_tokens = out_tokens + sum(f.prompt for f in done)
    return SimResult(
        request_rate=rate,
        duration_s=duration,
        output_tok_s=out_tokens / duration,
        total_tok_s=all_tokens / duration,
        ttft_p50_ms=percentile(ttft, 50) * 1e3,
        ttft_p99_ms=percentile(ttft, 99) * 1e3,
        tpot_p50_ms=percentile(tpot, 50) * 1e3 if tpot else 0.0,
        tpot_p99_ms=percentile(tpot, 99) * 1e3 if tpot else 0.0,
        mean_batch=rows_total / steps,
    )


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
