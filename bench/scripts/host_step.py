"""Host time per engine step with the model replaced by a stub (issue 52): what the CPU spends around the
GPU's work (schedule, update, output processing) at 256 running requests with ~900-token contexts, and
how much of it the device waits for, synchronous and with async scheduling.

    .venv/bin/python bench/scripts/host_step.py --output-json bench/results/avx2/host_step.json

The stub executor runs the real runner's host side of a step (its request states, the step's batch
tensors and block tables, the sampling metadata) but no model: it samples one fixed token per request
whose prompt is computed and allocates no KV cache, so every measured microsecond is host work:
`EngineCore.step` (scheduler, runner inputs, update) and the front end's `OutputProcessor.process`
(detokenize, stop checks, RequestOutputs), timed per decode-only step. A simulated device (a timeline)
then runs each launched step for `--device-ms`, one after another, as a GPU stream would: the time it
waits between steps is the host time that the device sees (`device_idle_ms`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.engine import engine_core
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.scheduler import Scheduler
from tokenmill.worker.input_batch import build_step_batch


class Device:
    """A stream on a simulated device, as a timeline: a step launched at time t starts when the device is
    free (t, or the end of the step before) and takes `step_s`; collecting it waits until its end. Records,
    per step, how long the device sat idle before it, waiting for the host to launch it. (A thread that
    sleeps through each step would need the GIL to finish one, which the host holds: the timeline
    needs nothing from the host, as a GPU does not.)"""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.free_at: float | None = None
        self.idle: list[tuple[float, bool]] = []  # (seconds idle before the step, a full decode step)

    def submit(self, full: bool) -> float:
        """Launch a step; returns when it ends."""
        now = time.perf_counter()
        start = now if self.free_at is None else max(now, self.free_at)
        if self.free_at is not None:
            self.idle.append((start - self.free_at, full))
        self.free_at = start + self.step_s
        return self.free_at

    @staticmethod
    def wait(end: float) -> None:
        while (left := end - time.perf_counter()) > 0:
            time.sleep(left)


class StubExecutor:
    """The real executor's driver and sizes, but no KV cache and no model step: a launched step's host
    side runs at once, its device side on the simulated device."""

    def __init__(self, real: Any, device: Device) -> None:
        self.real = real
        self.driver = real.driver
        self.sim = device
        self.scheduler: Scheduler | None = None  # set once the engine core exists
        self.input_times: list[float] = []
        self.launched: deque[tuple[float, ModelRunnerOutput]] = deque()  # (when it ends, its output)
        self.num_requests = 0

    @property
    def pipeline_depth(self) -> int:
        return 1

    @property
    def device(self) -> torch.device:
        return self.real.device

    def kv_cache_bytes_per_block(self) -> int:
        return int(self.real.kv_cache_bytes_per_block())

    def profile_run(self) -> None:
        pass

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def capture_cuda_graphs(self) -> None:
        pass

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.launch(sched)
        return self.collect()

    def collect(self) -> ModelRunnerOutput:
        end, output = self.launched.popleft()
        self.sim.wait(end)
        return output

    def launch(self, sched: SchedulerOutput) -> None:
        assert self.scheduler is not None
        start = time.perf_counter()
        runner = self.driver
        states = runner._update_states(sched)
        num_scheduled = [sched.num_scheduled_tokens[s.req_id] for s in states]
        if states:
            runner.block_tables.staging.begin_step()
            build_step_batch(states, num_scheduled, runner.block_size, runner.device, tables=runner.block_tables)
        sampled = {}
        sampling = []
        for state, n in zip(states, num_scheduled):
            state.num_computed_tokens += n
            if state.num_computed_tokens >= len(state.token_ids):
                sampled[state.req_id] = [1234]
                sampling.append(state)
        if sampling:
            runner._sampling_metadata(sampling)
        for state in sampling:
            state.token_ids.append(1234)
        self.input_times.append(time.perf_counter() - start)
        full = len(states) == self.num_requests and all(n == 1 for n in num_scheduled)
        self.launched.append((self.sim.submit(full), ModelRunnerOutput(sampled_token_ids=sampled)))

    def shutdown(self) -> None:
        self.real.shutdown()


def timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        record.append(time.perf_counter() - start)
        return out

    return wrapper


def hardware() -> str:
    """The CPU's name and matrix/vector units, as every figure must say."""
    info = open("/proc/cpuinfo").read()
    name = info.split("model name")[1].split("\n")[0].split(":", 1)[1].strip()
    flags = set(info.split("flags")[1].split("\n")[0].split())
    units = [u for u in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if u in flags]
    return f"{name} ({', '.join(units)})"


def run_once(args: argparse.Namespace, mode: str, device_ms: float) -> dict[str, Any]:
    """One generate of `num_requests` prompts with `--async-scheduling mode` on a device taking
    `device_ms` per step; medians over the decode steps that hold every request."""
    real_make = engine_core.make_executor
    device = Device(device_ms / 1e3)
    stubs: list[StubExecutor] = []

    def make_stub(*a: Any, **k: Any) -> StubExecutor:
        stubs.append(StubExecutor(real_make(*a, **k), device))
        return stubs[-1]

    engine_core.make_executor = make_stub  # type: ignore[assignment]
    from tokenmill import LLM

    blocks_per_request = -(-(args.prompt_len + args.output_len) // 16) + 1
    try:
        llm = LLM(
            None,
            max_num_seqs=args.num_requests,
            max_num_batched_tokens=16384,
            max_model_len=args.prompt_len + args.output_len + 16,
            num_kv_blocks=args.num_requests * blocks_per_request,
            async_scheduling=mode,
        )
    finally:
        engine_core.make_executor = real_make
    stub = stubs[-1]
    stub.scheduler, stub.num_requests = llm.engine.scheduler, args.num_requests
    step_times: list[float] = []
    process_times: list[float] = []
    full: list[bool] = []  # whether the step collected was decode-only with every request in it
    real_step = llm.engine.step
    real_collect = stub.collect
    waited = [0.0]

    def collect() -> ModelRunnerOutput:  # the host's wait for the device is not host work
        start = time.perf_counter()
        out = real_collect()
        waited[0] += time.perf_counter() - start
        return out

    def step() -> Any:
        waited[0] = 0.0
        start = time.perf_counter()
        out = real_step()
        step_times.append(time.perf_counter() - start - waited[0])
        shape = llm.engine.last_step
        full.append(shape.decode_rows == args.num_requests and shape.prefill_tokens == 0)
        if len(stub.input_times) < len(full):  # a step that launched nothing never reached the runner
            stub.input_times.append(0.0)
        return out

    stub.collect = collect  # type: ignore[method-assign]
    llm.engine.step = step  # type: ignore[method-assign]
    real_process = OutputProcessor.process
    OutputProcessor.process = timed(process_times, real_process)  # type: ignore[method-assign]

    rng = random.Random(0)
    vocab = llm.config.model.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_len)]}
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        OutputProcessor.process = real_process  # type: ignore[method-assign]
    wall = time.perf_counter() - start
    # Each engine step's outputs go through the processor once, so the i-th times belong together.
    core_ms = [t * 1e3 for t, keep in zip(step_times, full, strict=True) if keep]
    front_ms = [t * 1e3 for t, keep in zip(process_times, full, strict=False) if keep]
    idle_ms = [t * 1e3 for t, keep in device.idle if keep]
    return {
        "async_scheduling": mode,
        "device_ms": device_ms,
        "steps": len(step_times),
        "decode_steps_measured": len(core_ms),
        "core_step_ms_median": statistics.median(core_ms),
        "runner_inputs_ms_median": statistics.median(t * 1e3 for t in stub.input_times if t),
        "output_processing_ms_median": statistics.median(front_ms),
        "host_ms_per_step_median": statistics.median(c + f for c, f in zip(core_ms, front_ms, strict=True)),
        "device_idle_ms_median": statistics.median(idle_ms),
        "device_busy": device_ms / (device_ms + statistics.median(idle_ms)) if device_ms else None,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=900)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device-ms", default="5", help="comma-separated simulated device times per step")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case, alternating; medians")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    cases = [(mode, float(ms)) for ms in args.device_ms.split(",") for mode in ("off", "on")]
    runs: dict[str, list[dict[str, Any]]] = {f"{mode}@{ms:g}ms": [] for mode, ms in cases}
    for _ in range(args.repeats):
        for mode, ms in cases:
            run = run_once(args, mode, ms)
            runs[f"{mode}@{ms:g}ms"].append(run)
            print(json.dumps(run), flush=True)
    keys = ("core_step_ms_median", "runner_inputs_ms_median", "output_processing_ms_median")
    keys += ("host_ms_per_step_median", "device_idle_ms_median")
    medians = {case: {k: statistics.median(r[k] for r in rs) for k in keys} for case, rs in runs.items()}
    result = {
        "benchmark": "host_step",
        "command": "python bench/scripts/host_step.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output_json"),
        "cpu": hardware(),
        "torch": torch.__version__,
        "median_of_runs_ms": medians,
        "runs": runs,
    }
    print(json.dumps(medians, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
