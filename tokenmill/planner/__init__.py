"""Capacity and cost planning (`tokenmill plan`): how many replicas serve a peak load, and what they cost.

    from tokenmill.planner import PlanInputs, plan
    p = plan(PlanInputs(peak_rps=50, avg_input_tokens=500, avg_output_tokens=200,
                        tokens_per_s_per_replica=5000, utilization=0.7, redundancy=1.25))
    p.replicas, p.raw_replicas  # 13, 12.5

Pure Python: it imports no torch and nothing of the engine, so it runs anywhere.
"""

from tokenmill.planner.bench_file import BenchMeasurement, load_bench
from tokenmill.planner.capacity import Costs, Plan, PlanInputs, plan
from tokenmill.planner.hardware import GPU_PROFILES, HardwareProfile, get_profile, hardware_names, roofline_tok_s
from tokenmill.planner.sources import PlanRequest, resolve

__all__ = [
    "GPU_PROFILES",
    "BenchMeasurement",
    "Costs",
    "HardwareProfile",
    "Plan",
    "PlanInputs",
    "PlanRequest",
    "get_profile",
    "hardware_names",
    "load_bench",
    "plan",
    "resolve",
    "roofline_tok_s",
]
