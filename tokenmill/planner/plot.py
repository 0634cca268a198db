"""`tokenmill plan --plot`: one replica's simulated throughput against its p99 latencies, with the SLO lines."""

from __future__ import annotations

from tokenmill.planner.capacity import PlanInputs
from tokenmill.planner.latency import curve
from tokenmill.planner.step_model import StepCosts


def plot_curve(costs: StepCosts, lengths: list[tuple[int, int]], inputs: PlanInputs, path: str) -> None:
    """Write a PNG: TTFT p99 and TPOT p99 (ms) against total tok/s, rate by rate up to saturation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'tokenmill[plot]'.") from exc
    points = curve(costs, lengths)
    tok_s = [p.total_tok_s for p in points]
    fig, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, slo, name in (
        (ttft_ax, [p.ttft_p99_ms for p in points], inputs.ttft_slo_ms, "TTFT p99 (ms)"),
        (tpot_ax, [p.tpot_p99_ms for p in points], inputs.tpot_slo_ms, "TPOT p99 (ms)"),
    ):
        ax.plot(tok_s, values, marker="o")
        if slo is not None:
            ax.axhline(slo, color="red", linestyle="--", label=f"SLO {slo:g} ms")
            ax.legend()
        ax.set_xlabel("total tokens/s per replica")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    fig.suptitle("one replica, simulated from its calibration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
