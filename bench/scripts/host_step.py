"""Host time per engine step with the model replaced by a stub (issue 52): what the CPU spends around the
GPU's work (schedule, update, output processing) at 256 running requests with ~900-token contexts.

    .venv/bin/python bench/scripts/host_step.py --output-json bench/results/xeon-amx/host_step.json

The stub executor runs the real runner's host side of a step (its request states, the step's batch
tensors and block tables, the sampling metadata) but no model: it samples one fixed token per request
whose prompt is computed and allocates no KV cache, so every measured microsecond is host work:
`EngineCore.step` (scheduler, runner inputs, update) and the front end's `OutputProcessor.process`
(detokenize, stop checks, RequestOutputs), timed per decode-only step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.engine import engine_core
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.scheduler import Scheduler
from tokenmill.worker.input_batch import build_step_batch


class StubExecutor:
    """The real executor's driver and sizes, but no KV cache and no model step."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.driver = real.driver
        self.scheduler: Scheduler | None = None  # set once the engine core exists
        self.input_times: list[float] = []

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
        return ModelRunnerOutput(sampled_token_ids=sampled)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=900)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    real_make = engine_core.make_executor
    stubs: list[StubExecutor] = []

    def make_stub(*a: Any, **k: Any) -> StubExecutor:
        stubs.append(StubExecutor(real_make(*a, **k)))
        return stubs[-1]

    engine_core.make_executor = make_stub  # type: ignore[assignment]
    from tokenmill import LLM

    blocks_per_request = -(-(args.prompt_len + args.output_len) // 16) + 1
    llm = LLM(
        None,
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=16384,
        max_model_len=args.prompt_len + args.output_len + 16,
        num_kv_blocks=args.num_requests * blocks_per_request,
    )
    stubs[-1].scheduler = llm.engine.scheduler
    step_times: list[float] = []
    process_times: list[float] = []
    full: list[bool] = []  # whether the step was decode-only with every request in it
    real_step = timed(step_times, llm.engine.step)

    def step() -> Any:
        out = real_step()
        shape = llm.engine.last_step
        full.append(shape.decode_rows == args.num_requests and shape.prefill_tokens == 0)
        if len(stubs[-1].input_times) < len(full):  # a step that scheduled nothing never reached the runner
            stubs[-1].input_times.append(0.0)
        return out

    llm.engine.step = step  # type: ignore[method-assign]
    OutputProcessor.process = timed(process_times, OutputProcessor.process)  # type: ignore[method-assign]

    rng = random.Random(0)
    vocab = llm.config.model.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_len)]}
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    # Each engine step's outputs go through the processor once, so the i-th times belong together.
    core_ms = [t * 1e3 for t, keep in zip(step_times, full, strict=True) if keep]
    inputs_ms = [t * 1e3 for t, keep in zip(stubs[-1].input_times, full, strict=True) if keep]
    front_ms = [t * 1e3 for t, keep in zip(process_times, full, strict=False) if keep]
    result = {
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "steps": len(step_times),
        "decode_steps_measured": len(core_ms),
        "core_step_ms_median": statistics.median(core_ms),
        "runner_inputs_ms_median": statistics.median(inputs_ms),  # within the core step
        "output_processing_ms_median": statistics.median(front_ms),
        "host_ms_per_step_median": statistics.median(c + f for c, f in zip(core_ms, front_ms, strict=True)),
        "wall_s": wall,
        "cpu": hardware(),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
