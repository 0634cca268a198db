"""What every benchmark result carries besides its measurements: where it ran (`machine_info`) and, with
`--cost-per-hour`, what its tokens cost. `bench throughput`, `bench serve` and `bench compare` share them."""

from __future__ import annotations

import argparse
import os
import platform
from typing import Any


def add_cost_arg(parser: argparse.ArgumentParser) -> None:
    """`--cost-per-hour DOLLARS`, shared by `bench throughput` and `bench serve`."""
    parser.add_argument(
        "--cost-per-hour",
        type=positive_dollars,
        default=None,
        metavar="DOLLARS",
        help="what the machine costs per hour: also report $ per 1M output (and total) tokens",
    )


def positive_dollars(text: str) -> float:
    """argparse type of --cost-per-hour: a price above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of dollars, got {text!r}") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"the price must be > 0 dollars, got {text}")
    return value


def cost_per_million_tokens(cost_per_hour: float, tokens_per_s: float) -> float | None:
    """Dollars per 1M tokens at `tokens_per_s`: cost_per_hour / (3600 * tokens_per_s) * 1e6; None at 0 tok/s."""
    if tokens_per_s <= 0:
        return None
    return cost_per_hour / (3600 * tokens_per_s) * 1e6


def cost_report(cost_per_hour: float, output_tok_s: float, total_tok_s: float) -> dict[str, float | None]:
    """The cost fields a benchmark result carries in --output-json."""
    return {
        "cost_per_hour": cost_per_hour,
        "cost_per_million_output_tokens": cost_per_million_tokens(cost_per_hour, output_tok_s),
        "cost_per_million_total_tokens": cost_per_million_tokens(cost_per_hour, total_tok_s),
    }


def format_cost(cost: dict[str, float | None]) -> str:
    """The printed lines of `cost_report`."""

    def dollars(value: float | None) -> str:
        return "n/a (no tokens)" if value is None else f"${value:.4f}"

    return (
        f"  cost per 1M output tokens: {dollars(cost['cost_per_million_output_tokens'])}\n"
        f"  cost per 1M total tokens:  {dollars(cost['cost_per_million_total_tokens'])}"
        f" (at ${cost['cost_per_hour']:g}/hour)"
    )


def machine_info() -> dict[str, Any]:
    """What a benchmark result needs to say about where it ran."""
    import torch

    import tokenmill
    from tokenmill.bench.hardware_info import cpu_model_name

    info: dict[str, Any] = {
        "cpu_model": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tokenmill": tokenmill.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info
