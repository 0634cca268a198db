"""Benchmarks: standard workloads (datasets.py) and offline throughput (throughput.py); `tokenmill bench`
on the command line (cli.py)."""

from tokenmill.bench.datasets import WORKLOADS, BenchRequest, Workload, check_fits, make_workload
from tokenmill.bench.throughput import ThroughputResult, run_throughput

__all__ = [
    "WORKLOADS",
    "BenchRequest",
    "ThroughputResult",
    "Workload",
    "check_fits",
    "make_workload",
    "run_throughput",
]
