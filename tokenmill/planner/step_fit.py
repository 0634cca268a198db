"""Fit the step-time model (step_model.py) to what a served engine's steps cost on average.

A live server exports, per kind of step (decode, prefill, mixed), the number of steps, their wall seconds,
decode rows and prompt tokens (tokenmill:engine_step_*). Over a window each kind gives one average step:
`seconds / steps = base + per_row x rows / steps + per_token x tokens / steps`. Windows at several
concurrencies give rows and tokens enough spread to separate the three costs; a weighted least-squares fit
(each average weighted by its step count, so the fitted model reproduces the window's total busy time)
finds them, none below its physical bound.
"""

from __future__ import annotations

from dataclasses import dataclass

COST_NAMES = ("decode_base_s", "decode_per_row_s", "prefill_per_token_s")
MIN_BASE_S = 1e-4  # the least a step can cost: scheduling and launching the forward in Python
_LOWER = (MIN_BASE_S, 0.0, 0.0)


@dataclass(frozen=True)
class StepSample:
    """Totals over the steps of one kind in one window."""

    steps: int
    seconds: float
    decode_rows: int
    prefill_tokens: int


def fit_step_costs(samples: list[StepSample]) -> dict[str, float]:
    """{decode_base_s, decode_per_row_s, prefill_per_token_s} that best explain `samples`, within bounds.

    The costs are physical: a cost that would fit below its bound (zero; for the base, MIN_BASE_S: every
    step runs the scheduler and reads the weights) is held at the bound and the others are refitted.
    Raises ValueError when the samples hold no steps or cannot separate the costs (e.g. one window only)."""
    rows = [s for s in samples if s.steps > 0]
    if not rows:
        raise ValueError("no engine steps were measured; did the calibration's requests reach the server?")
    held: dict[int, float] = {}
    while True:
        coef = _weighted_least_squares(rows, held)
        below = [i for i in range(3) if i not in held and coef[i] < _LOWER[i]]
        if not below:
            return dict(zip(COST_NAMES, coef))
        worst = min(below, key=lambda i: coef[i] - _LOWER[i])
        held[worst] = _LOWER[worst]


def _features(sample: StepSample) -> tuple[float, float, float]:
    """The average step's (1, rows, tokens)."""
    return 1.0, sample.decode_rows / sample.steps, sample.prefill_tokens / sample.steps


def _weighted_least_squares(samples: list[StepSample], held: dict[int, float]) -> list[float]:
    """Coefficients of the three features, those in `held` fixed at their value, weighted by step count."""
    free = [i for i in range(3) if i not in held]
    n = len(free)
    normal = [[0.0] * n for _ in range(n)]
    rhs = [0.0] * n
    for sample in samples:
        x = _features(sample)
        y = sample.seconds / sample.steps - sum(x[i] * v for i, v in held.items())
        for a in range(n):
            rhs[a] += sample.steps * x[free[a]] * y
            for b in range(n):
                normal[a][b] += sample.steps * x[free[a]] * x[free[b]]
    solved = _solve(normal, rhs) if n else []
    coef = [held.get(i, 0.0) for i in range(3)]
    for a, i in enumerate(free):
        coef[i] = solved[a]
    return coef


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; ValueError when the system is singular."""
    n = len(rhs)
    m = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    scale = max((abs(v) for row in matrix for v in row), default=0.0)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * max(scale, 1.0):
            raise ValueError(
                "the measured steps cannot separate the base, per-row and per-token costs: calibrate over "
                "more concurrencies (decode rows and prompt tokens must vary between windows)."
            )
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [a - factor * b for a, b in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]
