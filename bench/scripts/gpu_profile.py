"""Where an engine step's time goes on a GPU: the host's phases (scheduling, the runner's step, which waits
for the GPU at its one sync, the scheduler's and the output processor's bookkeeping) timed on the wall
clock, and the device's kernels (torch.profiler) over the same steps, so the GPU's busy share of a step
shows how much of it the host costs. Steps past --skip-steps (the prompts' prefill done) are measured.

Usage: python bench/scripts/gpu_profile.py --model qwen3-0.6b --load-format dummy --device cuda \
           --max-num-seqs 256 --max-num-batched-tokens 8192 --workload random-gpu --out-dir DIR
Writes DIR/profile.json (per-step milliseconds) and DIR/kernels.txt (the top device kernels).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from tokenmill import LLM
from tokenmill.bench.datasets import make_workload
from tokenmill.engine.engine_args import add_engine_args, engine_kwargs


class PhaseTimer:
    """Accumulates the wall time of wrapped methods while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.ms: dict[str, float] = {}

    def wrap(self, owner: Any, method: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.on:
                    self.ms[phase] = self.ms.get(phase, 0.0) + (time.perf_counter() - start) * 1e3

        setattr(owner, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--workload", default="random-gpu")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-prompt-len", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument("--skip-steps", type=int, default=60, help="steps before measuring (prefill)")
    parser.add_argument("--steps", type=int, default=40, help="steps measured")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.engine
    on_cuda = engine.runner.device.type == "cuda"
    requests = make_workload(
        args.workload,
        llm.config.model.vocab_size,
        seed=args.seed,
        num_requests=args.num_prompts,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
    )
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.executor, "execute", "runner step (waits for the GPU)")
    # Async scheduling (on CUDA by default) launches a step, then collects the one before it.
    timer.wrap(engine.executor, "launch", "runner launch")
    timer.wrap(engine.executor, "collect", "runner collect (waits for the GPU)")
    timer.wrap(engine.scheduler, "update_from_output", "scheduler update")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    step_ms: list[float] = []
    gap_ms: list[float] = []  # from a step's end to the next one's start: LLM.generate's output processing
    rows: list[int] = []
    last_end = 0.0
    window = schedule(wait=args.skip_steps, warmup=2, active=args.steps, repeat=1)
    with profile(activities=activities, schedule=window) as prof:
        step = engine.step
        count = 0

        def profiled_step() -> Any:
            nonlocal count, last_end
            active = args.skip_steps + 2 <= count < args.skip_steps + 2 + args.steps
            timer.on = active
            start = time.perf_counter()
            out = step()
            if active:
                step_ms.append((time.perf_counter() - start) * 1e3)
                gap_ms.append((start - last_end) * 1e3)
                rows.append(engine.last_step.decode_rows)
            last_end = time.perf_counter()
            count += 1
            prof.step()
            return out

        engine.step = profiled_step  # type: ignore[method-assign]
        start = time.perf_counter()
        llm.generate([r.prompt for r in requests], [r.sampling_params() for r in requests], use_tqdm=False)
        total_s = time.perf_counter() - start
    measured = len(step_ms)
    if measured == 0:
        raise SystemExit(f"the run took {count} steps: fewer than --skip-steps + 2 + 1; lower --skip-steps")
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) if on_cuda else 0.0
    report = {
        "model": args.model,
        "device": str(engine.runner.device),
        "gpu": torch.cuda.get_device_name(0) if on_cuda else None,
        "steps_measured": measured,
        "mean_decode_rows": sum(rows) / measured,
        "step_ms": sum(step_ms) / measured,
        "phases_ms_per_step": {k: v / measured for k, v in timer.ms.items()}
        | {"output processing (between steps)": sum(gap_ms) / measured},
        "device_kernels_ms_per_step": device_us / 1e3 / measured,
        "device_busy_share": device_us / 1e3 / sum(step_ms) if on_cuda else None,
        "run_s": total_s,
        "config": {
            "max_num_seqs": llm.config.scheduler.max_num_seqs,
            "enforce_eager": llm.config.enforce_eager,
            "async_scheduling": llm.config.scheduler.async_scheduling,
        },
    }
    print(json.dumps(report, indent=2))
    (args.out_dir / "profile.json").write_text(json.dumps(report, indent=2) + "\n")
    sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    (args.out_dir / "kernels.txt").write_text(events.table(sort_by=sort_by, row_limit=30))


if __name__ == "__main__":
    main()
