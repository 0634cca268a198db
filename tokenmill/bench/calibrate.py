"""`tokenmill bench calibrate`: one short run that measures what an engine step costs, for `tokenmill plan`.

    tokenmill bench calibrate --workload random-cpu --output-json profile.json
    tokenmill plan --peak-rps 5 --profile profile.json --ttft-slo-ms 2000 --tpot-slo-ms 100

It times decode-only steps at a few batch sizes (contexts as long as the workload's average) and prompt-only
steps, fits `seconds = base + per_row x rows + per_prefill_token x tokens` (tokenmill/planner/step_model.py)
and writes it with the engine's batch limits and the workload's (prompt, output) lengths.

    tokenmill bench calibrate --server http://127.0.0.1:8000 --output-json profile.json

measures the same costs through a live server instead (calibrate_server.py): the steps as they are served,
slowed by whatever shares the machine with the engine. Pass the server's --max-num-seqs and
--max-num-batched-tokens when they are not the defaults; the profile records them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.bench.datasets import MAX_TOKEN_ID, WORKLOADS, BenchRequest, make_workload
from tokenmill.bench.throughput import warm_up
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM

DECODE_BATCHES = (1, 4, 16, 64)
DECODE_STEPS = 24  # tokens per request in a decode point: enough steps to average, few enough to stay short
PREFILL_ROUNDS = 4  # timed prompt-only steps of each size


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    from tokenmill.engine.engine_args import add_engine_args

    parser = subparsers.add_parser(
        "calibrate",
        help="measure an engine step's cost (decode rows, prompt tokens) for `tokenmill plan --profile`",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(parser)
    parser.add_argument("--workload", default="random-cpu", choices=[w for w in WORKLOADS if w != "copy-edit"])
    parser.add_argument("--num-prompts", type=int, default=None, help="override the workload's request count")
    parser.add_argument("--output-json", type=Path, required=True, help="where to write the profile")
    parser.add_argument("--server", default=None, help="calibrate through this live server (base URL, no /v1)")
    parser.add_argument("--api-key", default=None, help="with --server: sent as a Bearer token")
    parser.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> None:
    if args.server is not None:
        profile = _calibrate_through_server(args)
    else:
        from tokenmill import LLM
        from tokenmill.engine.engine_args import engine_kwargs

        llm = LLM(args.model, **engine_kwargs(args))
        vocab = llm.config.model.vocab_size
        requests = make_workload(args.workload, vocab, seed=args.seed, num_requests=args.num_prompts)
        profile = calibrate(llm, requests) | {"model": llm.config.model.model}
    profile |= {"command": shlex.join(sys.argv), "workload": args.workload}
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(profile, indent=2) + "\n")
    costs = profile["step_costs"]
    print(
        f"step = {costs['decode_base_s'] * 1e3:.2f} ms + {costs['decode_per_row_s'] * 1e3:.3f} ms x decode rows"
        f" + {costs['prefill_per_token_s'] * 1e6:.1f} us x prompt tokens  ->  {args.output_json}"
    )


def _calibrate_through_server(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.bench.calibrate_server import calibrate_server, served_model, window_sizes

    base_url = args.server.rstrip("/")
    model = served_model(base_url, args.api_key)
    count = args.num_prompts or sum(n for _, n in window_sizes(args.max_num_seqs))
    # A seed of its own: the windows' prompts must not be cached for the runs the profile predicts.
    requests = make_workload(args.workload, MAX_TOKEN_ID, seed=args.seed + 10_000, num_requests=count)
    measured = calibrate_server(base_url, model, requests, args.max_num_seqs, args.api_key)
    limits = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    return {
        "step_costs": measured["costs"] | limits,
        "server": base_url,
        "server_windows": measured["windows"],
        "lengths": [[len(r.prompt_token_ids), r.output_len] for r in requests],
        "model": model,
    }


def calibrate(llm: LLM, requests: list[BenchRequest]) -> dict[str, Any]:
    """The profile `tokenmill plan --profile` reads (see module docstring)."""
    warm_up(llm)
    sched = llm.config.scheduler
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    output_lens = [r.output_len for r in requests]
    temperature = requests[0].temperature
    # Decode points run at the workload's average context: its mean prompt plus half its mean output.
    context = int(np.mean(prompt_lens) + np.mean(output_lens) / 2) - DECODE_STEPS // 2
    context = max(1, min(context, llm.config.model.max_model_len - DECODE_STEPS))
    rng = np.random.default_rng(1234)
    high = min(MAX_TOKEN_ID, llm.config.model.vocab_size)
    points: list[tuple[int, float]] = []  # (rows, seconds per decode-only step)
    for batch in [b for b in DECODE_BATCHES if b <= sched.max_num_seqs]:
        stats = llm.engine.decode_stats
        steps, seconds = stats.steps, stats.seconds
        prompts = [{"prompt_token_ids": rng.integers(0, high, context).tolist()} for _ in range(batch)]
        params = SamplingParams(max_tokens=DECODE_STEPS, temperature=temperature, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        points.append((batch, (stats.seconds - seconds) / max(1, stats.steps - steps)))
    rows = np.array([p[0] for p in points], dtype=np.float64)
    secs = np.array([p[1] for p in points], dtype=np.float64)
    per_row, base = np.polyfit(rows, secs, 1) if len(points) > 1 else (0.0, secs[0])
    per_row = max(0.0, float(per_row))
    base = float(base) if base > 0 else float(secs.min())
    # Prompt-only steps of one prompt (the workload's mean length) and of a full token budget of them, one
    # output token each; the per-token cost is the slope between the two step sizes. A first untimed round
    # keeps one-time costs of the largest step (allocations) out of it.
    prompt_len = max(1, min(int(np.mean(prompt_lens)), sched.max_num_batched_tokens))
    per_step = max(1, sched.max_num_batched_tokens // prompt_len)
    params = SamplingParams(max_tokens=1, temperature=temperature)

    def prompts(n: int) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": rng.integers(0, high, prompt_len).tolist()} for _ in range(n)]

    llm.generate(prompts(per_step), params, use_tqdm=False)
    single = _seconds_per_step(llm, [prompts(1) for _ in range(PREFILL_ROUNDS)], params)
    full = _seconds_per_step(llm, [prompts(per_step) for _ in range(PREFILL_ROUNDS)], params)
    tokens_full = per_step * prompt_len
    if tokens_full > prompt_len and full > single:
        per_token = (full - single) / (tokens_full - prompt_len)
    else:  # one prompt fills the budget: the step's whole time over its tokens
        per_token = full / tokens_full
    return {
        "step_costs": {
            "decode_base_s": base,
            "decode_per_row_s": per_row,
            "prefill_per_token_s": per_token,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
        },
        "decode_points": [{"rows": r, "step_s": s} for r, s in points],
        "prefill": {
            "prompt_len": prompt_len,
            "prompts_per_full_step": per_step,
            "one_prompt_step_s": single,
            "full_step_s": full,
        },
        "lengths": [[p, o] for p, o in zip(prompt_lens, output_lens)],
    }


def _seconds_per_step(llm: LLM, batches: list[list[dict[str, list[int]]]], params: SamplingParams) -> float:
    """Wall seconds per engine step over `batches`, one `generate` call each."""
    steps_before = llm.engine.scheduler.stats.num_steps
    start = time.perf_counter()
    for batch in batches:
        llm.generate(batch, params, use_tqdm=False)
    return (time.perf_counter() - start) / max(1, llm.engine.scheduler.stats.num_steps - steps_before)
