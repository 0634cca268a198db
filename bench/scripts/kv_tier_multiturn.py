"""A second KV tier on multi-turn chat (issue 49): TTFT and throughput with and without --kv-offloading-size.

Usage: .venv/bin/python bench/scripts/kv_tier_multiturn.py [--conversations 32] [--turns 6] [--concurrency 4]
           [--quick] [--output bench/results/xeon-amx/kv_tier_multiturn.json]

`tokenmill serve` on the embedded default model. Each conversation starts with its own system prefix
(--system tokens) and each turn adds a user message (--user tokens) after the previous answer (--answer
tokens, max_tokens, ignore_eos), so its history grows to system + turns x (user + answer) tokens. Turns go
round-robin over the conversations, --concurrency requests in flight: between two turns of one
conversation every other conversation has a turn, so its prefix must outlive all of their KV. The KV cache
gets --pool-share of the working set (the sum of the final histories; default a quarter). Prompts are token
ids (seeded), streamed completions; TTFT is sending to the first chunk. Answers are not fed back (a fixed
stand-in of the same length is), so every configuration sends the same prompts.

Configurations, each a fresh server:
- no tier, and a tier (--kv-offloading-size, an empty --kv-offloading-path): the whole workload;
- a restart: after the tier run's server stops (its KV cache goes to the file tier), a new server on the
  same folder gets each conversation's next turn, against the same turns on a fresh server without a tier;
- fits: a small workload whose working set fits the KV cache, without and with a tier (throughput must not
  drop).
Reported per configuration: TTFT p50/p99, output tok/s, prompt tokens and cached prompt tokens (usage's
prompt_tokens_details.cached_tokens), and the ratios; the JSON goes to --output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.hardware_info import cpu_model_name, isa_flags

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import ROOT, Server  # noqa: E402  (a sibling script: how a benchmark runs `tokenmill serve`)

BLOCK = 16
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # SmolLM2-135M: layers x KV heads x head_dim x (k, v) x bf16
VOCAB = (1000, 40000)  # token ids drawn from here: no special tokens


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system: int  # tokens of each conversation's own system prefix
    user: int  # tokens of each user message
    answer: int  # max_tokens of each turn, and the stand-in answer's length in the next turn's history
    seed: int = 0

    def prompt(self, conversation: int, turn: int) -> list[int]:
        """Turn `turn` (0-based) of a conversation: its system prefix, then per turn so far a user message,
        with a stand-in answer after each earlier one."""
        rng = random.Random(self.seed * 1_000_003 + conversation)
        tokens = [rng.randrange(*VOCAB) for _ in range(self.system)]
        for t in range(turn + 1):
            tokens += [rng.randrange(*VOCAB) for _ in range(self.user)]
            if t < turn:
                tokens += [rng.randrange(*VOCAB) for _ in range(self.answer)]
        return tokens

    def order(self, turns: range | None = None) -> list[tuple[int, int]]:
        """(conversation, turn) in sending order: round-robin over the conversations, turn by turn."""
        return [(c, t) for t in (turns or range(self.turns)) for c in range(self.conversations)]

    @property
    def final_history(self) -> int:
        return self.system + self.turns * self.user + (self.turns - 1) * self.answer

    @property
    def working_set_tokens(self) -> int:
        return self.conversations * self.final_history


async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict[str, float]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    if ttft is None or usage is None:
        raise RuntimeError("a stream ended without a token or without usage")
    return {
        "ttft": ttft,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "completion_tokens": usage["completion_tokens"],
    }


async def run(url: str, work: Workload, order: list[tuple[int, int]], concurrency: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)
    # A conversation's next turn waits for its previous one (a user reads the answer first).
    first_turn = {c: min(t for cc, t in order if cc == c) for c in {c for c, _ in order}}

    async def turn(client: httpx.AsyncClient, c: int, t: int, previous: asyncio.Event | None) -> dict[str, float]:
        if previous is not None:
            await previous.wait()
        async with gate:
            return await one(client, work.prompt(c, t), work.answer)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        tasks = []
        events: dict[tuple[int, int], asyncio.Event] = {}
        for c, t in order:
            events[(c, t)] = asyncio.Event()
            previous = events.get((c, t - 1)) if t > first_turn[c] else None
            task = asyncio.ensure_future(turn(client, c, t, previous))
            task.add_done_callback(lambda _task, e=events[(c, t)]: e.set())
            tasks.append(task)
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ms = sorted(r["ttft"] * 1000 for r in results)
    return {
        "requests": len(results),
        "ttft_ms_p50": round(statistics.median(ms), 1),
        "ttft_ms_p99": round(ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))], 1),
        "ttft_ms_mean": round(statistics.fmean(ms), 1),
        "wall_s": round(wall, 2),
        "output_tok_per_s": round(sum(r["completion_tokens"] for r in results) / wall, 1),
        "prompt_tokens": int(sum(r["prompt_tokens"] for r in results)),
        "cached_tokens": int(sum(r["cached_tokens"] for r in results)),
    }


def serve(port: int, args: list[str], name: str) -> Server:
    server = Server(port, args, Path(tempfile.gettempdir()) / f"kv_tier_multiturn.{name}.log")
    server.wait_ready()
    return server


def measure(
    port: int, server_args: list[str], name: str, work: Workload, order: list[tuple[int, int]], conc: int
) -> dict[str, Any]:
    server = serve(port, server_args, name)
    try:
        warm = Workload(2, 1, 64, 32, 4, seed=99)  # the first shapes, off the clock
        asyncio.run(run(server.url, warm, warm.order(), 2))
        result = asyncio.run(run(server.url, work, order, conc))
    finally:
        server.stop()
    result["server_args"] = server_args
    print(name, result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8049)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=512)
    parser.add_argument("--user", type=int, default=160)
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pool-share", type=float, default=0.25, help="KV cache / working set")
    parser.add_argument("--tier-gib", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="a tiny run (a smoke test, under a minute)")
    parser.add_argument("--output", default=str(ROOT / "bench/results/xeon-amx/kv_tier_multiturn.json"))
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.system, args.user, args.answer = 4, 3, 64, 32, 8

    work = Workload(args.conversations, args.turns, args.system, args.user, args.answer)
    # At least two of the longest requests (the restart's next turns) fit.
    longest = work.final_history + args.answer + args.user + args.answer
    pool_blocks = max(2 * -(-longest // BLOCK), int(work.working_set_tokens * args.pool_share) // BLOCK)
    common = ["--num-kv-blocks", str(pool_blocks), "--max-model-len", str(work.final_history + 2 * args.user + 64)]
    tier_dir = tempfile.mkdtemp(prefix="tokenmill-kv-tier-")
    tier = ["--kv-offloading-size", str(args.tier_gib), "--kv-offloading-path", tier_dir]
    order = work.order()
    # The restart: each conversation's next turn (its whole history a prefix) on a new server.
    longer = Workload(args.conversations, args.turns + 1, args.system, args.user, args.answer)
    next_turns = longer.order(range(args.turns, args.turns + 1))
    fits = Workload(max(2, args.conversations // 4), args.turns, args.system, args.user, args.answer, seed=7)
    fits_args = ["--num-kv-blocks", str(2 * fits.working_set_tokens // BLOCK), common[2], common[3]]

    results: dict[str, Any] = {}
    results["no_tier"] = measure(args.port, common, "no_tier", work, order, args.concurrency)
    results["tier"] = measure(args.port, common + tier, "tier", work, order, args.concurrency)
    results["restart_no_tier"] = measure(args.port, common, "restart_no_tier", longer, next_turns, args.concurrency)
    results["restart_warm_tier"] = measure(
        args.port, common + tier, "restart_warm_tier", longer, next_turns, args.concurrency
    )
    fits_tier = [
        "--kv-offloading-size",
        str(args.tier_gib),
        "--kv-offloading-path",
        tempfile.mkdtemp(prefix="tokenmill-kv-tier-"),
    ]
    results["fits_no_tier"] = measure(args.port, fits_args, "fits_no_tier", fits, fits.order(), args.concurrency)
    results["fits_tier"] = measure(args.port, fits_args + fits_tier, "fits_tier", fits, fits.order(), args.concurrency)

    def ratio(a: str, b: str, key: str) -> float:
        return round(results[a][key] / results[b][key], 2)

    report = {
        "benchmark": "kv_tier_multiturn",
        "cpu": cpu_model_name(),
        "cpu_isa": [name for name, present in isa_flags().items() if present],
        "machine": platform.machine(),
        "model": "embedded default (SmolLM2-135M-Instruct), bf16 KV cache",
        "workload": {
            "conversations": work.conversations,
            "turns": work.turns,
            "system_tokens": work.system,
            "user_tokens": work.user,
            "answer_tokens": work.answer,
            "final_history_tokens": work.final_history,
            "working_set_tokens": work.working_set_tokens,
            "kv_cache_tokens": pool_blocks * BLOCK,
            "working_set_over_kv_cache": round(work.working_set_tokens / (pool_blocks * BLOCK), 2),
            "working_set_gib": round(work.working_set_tokens * KV_BYTES_PER_TOKEN / 2**30, 2),
            "concurrency": args.concurrency,
        },
        "results": results,
        "ttft_p50_no_tier_over_tier": ratio("no_tier", "tier", "ttft_ms_p50"),
        "ttft_p99_no_tier_over_tier": ratio("no_tier", "tier", "ttft_ms_p99"),
        "throughput_tier_over_no_tier": ratio("tier", "no_tier", "output_tok_per_s"),
        "restart_ttft_p50_no_tier_over_warm_tier": ratio("restart_no_tier", "restart_warm_tier", "ttft_ms_p50"),
        "fits_throughput_tier_over_no_tier": ratio("fits_tier", "fits_no_tier", "output_tok_per_s"),
        "target": "TTFT p50 >= 2x better with the tier; no throughput loss when the working set fits",
        "command": "python bench/scripts/kv_tier_multiturn.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
