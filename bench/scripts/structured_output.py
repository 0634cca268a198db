"""Structured output costs (issue 26): grammar compile time, the per-step mask, and serving throughput.

Usage: .venv/bin/python bench/scripts/structured_output.py [--port 8023] [--output bench/results/structured_output.json]
           [--skip-serve] [--steps 200] [--repeats 5]

1. Compile: the embedded default model's tokenizer read by llguidance (once per tokenizer), then JSON schemas of
   growing size, a regex and a choice through tokenmill.structured's GrammarCompiler: the first (cold) compile, a
   cached one (the compiler's spec-hash cache), and a request's matcher copy; medians over --repeats fresh compilers.
2. Mask: N = 1, 8, 32 constrained rows in a StructuredOutputManager, each a few random tokens into its JSON output;
   per step the manager fills the bitmask, apply_token_bitmask masks [N, vocab] float32 logits, the argmax (not
   timed) picks an allowed token and the manager accepts it. p50/p99 over --steps steps; a row whose grammar ends
   starts again.
3. Serve: `tokenmill serve` on the embedded model; 32 concurrent chat requests with a bounded response_format
   json_schema, and the same 32 unconstrained with ignore_eos and each request's max_tokens set to its constrained
   output length (from a warm-up run), greedy. Output tok/s = sum of completion_tokens / wall time; three
   (unconstrained, constrained) pairs, medians quoted. Then streamed TTFT of a never-seen schema (a fresh enum
   value) against the same schema again, and of no schema; medians of 5.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import llguidance
import numpy as np
import torch

from tokenmill.config import EngineArgs
from tokenmill.engine.engine_args import create_engine_config
from tokenmill.loader.hf import load_tokenizer
from tokenmill.sample.bitmask import TokenBitmask, apply_token_bitmask
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.backend import Grammar
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.llguidance_backend import LLGuidanceBackend
from tokenmill.structured.manager import StructuredOutputManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import ROOT, Server  # noqa: E402  (a sibling script: how a benchmark runs `tokenmill serve`)

FIELD_KINDS: list[dict[str, Any]] = [
    {"type": "string", "maxLength": 16},
    {"type": "integer", "minimum": 0, "maximum": 999},
    {"enum": ["red", "green", "blue", "amber"]},
    {"type": "boolean"},
    {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    {"type": "number"},
]
# What the served requests ask for: every field bounded, so the output ends on its own.
SERVE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["engineer", "artist", "farmer", "doctor", "pilot"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "role", "age", "skills", "city"],
    "additionalProperties": False,
}
NUM_REQUESTS, PAIRS, TTFT_REPEATS = 32, 3, 5
CHAT = "/v1/chat/completions"


def object_schema(num_fields: int, depth: int = 0) -> dict[str, Any]:
    """An object of `num_fields` bounded fields; every 8th a nested object of 4 (two levels at most)."""
    props = {
        f"f{i}": object_schema(4, depth + 1) if i % 8 == 7 and depth < 2 else FIELD_KINDS[i % len(FIELD_KINDS)]
        for i in range(num_fields)
    }
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def compile_specs() -> dict[str, StructuredOutputsParams]:
    specs = {}
    for n in (1, 4, 16, 64, 256):
        schema = object_schema(n)
        specs[f"json {n} fields ({len(json.dumps(schema))} B)"] = StructuredOutputsParams(json=schema)
    date_time = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d(:[0-5]\d(\.\d{1,6})?)?"
    specs["regex (ISO date-time)"] = StructuredOutputsParams(regex=date_time + r"(Z|[+-]\d{2}:\d{2})")
    specs["choice (20 options)"] = StructuredOutputsParams(choice=[f"option number {i}" for i in range(20)])
    return specs


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3)


def table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    cells = [headers, *[[f"{c:g}" if isinstance(c, float) else str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


# ---------------------------------------------------------------------- 1. compile
def bench_compile(source: Any, vocab_size: int, repeats: int) -> tuple[LLGuidanceBackend, dict[str, Any]]:
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(source.tokenizer)
    t1 = time.perf_counter()
    backend = LLGuidanceBackend(tokenizer, vocab_size, source.eos_token_ids)
    t2 = time.perf_counter()
    result: dict[str, Any] = {"load_tokenizer_ms": ms(t1 - t0), "llguidance_tokenizer_ms": ms(t2 - t1), "specs": {}}
    for name, spec in compile_specs().items():
        cold, cached, copies = [], [], []
        for _ in range(repeats):
            compiler = GrammarCompiler(lambda: backend)  # an empty cache on the built backend
            t0 = time.perf_counter()
            grammar = compiler.compile(spec)
            t1 = time.perf_counter()
            compiler.compile(spec)
            t2 = time.perf_counter()
            grammar.matcher()
            t3 = time.perf_counter()
            cold.append(t1 - t0)
            cached.append(t2 - t1)
            copies.append(t3 - t2)
        result["specs"][name] = {
            "cold_first_ms": ms(cold[0]),
            "cold_ms": ms(statistics.median(cold)),
            "cached_ms": ms(statistics.median(cached)),
            "matcher_copy_ms": ms(statistics.median(copies)),
        }
    table(
        f"grammar compile (medians of {repeats}); tokenizer load {result['load_tokenizer_ms']:g} ms, "
        f"llguidance tokenizer build (once) {result['llguidance_tokenizer_ms']:g} ms",
        ["spec", "cold first ms", "cold ms", "cached ms", "matcher copy ms"],
        [[name, *r.values()] for name, r in result["specs"].items()],
    )
    return backend, result


# ---------------------------------------------------------------------- 2. per-step mask
def walk(grammar: Grammar, num_words: int, vocab_size: int, steps: int, gen: torch.Generator) -> list[int]:
    """`steps` random allowed tokens from the grammar's start (stopping where it ends)."""
    matcher, bits, tokens = grammar.matcher(), torch.empty((1, num_words), dtype=torch.int32), []
    for _ in range(steps):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bits, 0)
        logits = torch.rand((1, vocab_size), generator=gen)  # [1, vocab]
        apply_token_bitmask(logits, TokenBitmask(bits))
        tokens.append(int(logits.argmax()))
        matcher.accept_tokens(tokens[-1:])
    return tokens


def bench_mask(backend: LLGuidanceBackend, vocab_size: int, steps: int) -> dict[str, Any]:
    spec = StructuredOutputsParams(json=object_schema(16))
    compiler = GrammarCompiler(lambda: backend)
    grammar, gen, result = compiler.compile(spec), torch.Generator().manual_seed(0), {}
    for n in (1, 8, 32):
        manager = StructuredOutputManager(compiler, n, torch.device("cpu"))
        req_ids = [f"r{i}" for i in range(n)]
        for i, rid in enumerate(req_ids):  # as a resumed request: the manager accepts its earlier tokens
            manager.add_request(rid, spec, walk(grammar, backend.num_words, vocab_size, 3 + i % 13, gen))
        times: dict[str, list[float]] = {"fill": [], "apply": [], "accept": [], "total": []}
        for _ in range(steps):
            logits = torch.randn((n, vocab_size), generator=gen)  # [n, vocab]
            t0 = time.perf_counter()
            mask = manager.bitmask(req_ids)
            t1 = time.perf_counter()
            if mask is None:
                raise RuntimeError("every row is constrained, yet the manager made no bitmask")
            apply_token_bitmask(logits, mask)
            t2 = time.perf_counter()
            tokens = logits.argmax(dim=1).tolist()  # the sampler's part: not timed
            t3 = time.perf_counter()
            manager.accept(req_ids, tokens)
            t4 = time.perf_counter()
            for key, dt in (("fill", t1 - t0), ("apply", t2 - t1), ("accept", t4 - t3), ("total", t4 - t3 + t2 - t0)):
                times[key].append(dt * 1e3)
            for rid in req_ids:
                if manager.matchers[rid].is_terminated():  # its output is complete: start it again
                    manager.remove_request(rid)
                    manager.add_request(rid, spec, [])
        result[str(n)] = {f"{k}_ms_{q}": pct(v, float(q[1:])) for k, v in times.items() for q in ("p50", "p99")}
    keys = [f"{k}_ms_{q}" for k in ("fill", "apply", "accept", "total") for q in ("p50", "p99")]
    table(
        f"per-step mask, json 16 fields, vocab {vocab_size}, {steps} steps (ms)",
        ["rows", *(k.replace("_ms_", " ") for k in keys)],
        [[n, *(r[k] for k in keys)] for n, r in result.items()],
    )
    return result


# ---------------------------------------------------------------------- 3. serving
def chat_body(model: str, i: int, schema: dict[str, Any] | None, max_tokens: int, **extra: Any) -> dict[str, Any]:
    prompt = f"Invent character number {i} for a story. Reply in JSON with name, role, age, skills and city."
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body.update(temperature=0.0, seed=i, **extra)
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "character", "schema": schema}}
    return body


async def run_batch(client: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    responses = await asyncio.gather(*(client.post(CHAT, json=b) for b in bodies))
    wall = time.perf_counter() - t0
    for r in responses:
        if r.status_code != 200:
            raise RuntimeError(f"a request failed: {r.status_code} {r.text[:300]}")
    data = [r.json() for r in responses]
    tokens = [d["usage"]["completion_tokens"] for d in data]
    valid = 0
    for d in data:
        try:
            valid += isinstance(json.loads(d["choices"][0]["message"]["content"]), dict)
        except (TypeError, json.JSONDecodeError):
            pass
    return {"wall_s": round(wall, 3), "tokens": tokens, "tok_s": round(sum(tokens) / wall, 1), "valid_json": valid}


async def ttft(client: httpx.AsyncClient, body: dict[str, Any]) -> float:
    """Seconds to the first chunk with content (the role chunk comes before any token); reads to the end."""
    first, t0 = None, time.perf_counter()
    async with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"no content streamed ({r.status_code})")
    return first


async def bench_serve(url: str, model: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await run_batch(client, [chat_body(model, 0, None, 4)])  # warm-up
        ids = range(NUM_REQUESTS)
        constrained = [chat_body(model, i, SERVE_SCHEMA, 256) for i in ids]
        lengths = (await run_batch(client, constrained))["tokens"]  # also compiles the schema
        free = [chat_body(model, i, None, max(n, 1), ignore_eos=True) for i, n in zip(ids, lengths)]
        runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "constrained": []}
        for _ in range(PAIRS):
            runs["unconstrained"].append(await run_batch(client, free))
            runs["constrained"].append(await run_batch(client, constrained))
        ttfts: dict[str, list[float]] = {"cold schema": [], "cached schema": [], "no schema": []}
        for k in range(TTFT_REPEATS):
            schema = copy.deepcopy(SERVE_SCHEMA)
            schema["properties"]["role"]["enum"].append(f"r{uuid.uuid4().hex[:8]}")  # never seen
            for key, s in (("cold schema", schema), ("cached schema", schema), ("no schema", None)):
                ttfts[key].append(ms(await ttft(client, chat_body(model, 100 + k, s, 8))))
    median = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    result = {
        "constrained_lengths_mean": round(statistics.mean(lengths), 1),
        "runs": runs,
        "median_tok_s": median,
        "ratio": round(median["constrained"] / median["unconstrained"], 3),
        "ttft_ms": {k: {"median": statistics.median(v), "all": v} for k, v in ttfts.items()},
    }
    table(
        f"serving, {NUM_REQUESTS} concurrent chat requests, greedy (output tok/s; pairs run in this order)",
        ["run", *(f"pair {i + 1}" for i in range(PAIRS)), "median", "tokens", "valid JSON"],
        [
            [k, *(r["tok_s"] for r in v), median[k], sum(v[-1]["tokens"]), f"{v[-1]['valid_json']}/{NUM_REQUESTS}"]
            for k, v in runs.items()
        ],
    )
    print(f"ratio constrained/unconstrained: {result['ratio']:.3f}x (target >= 0.9x)")
    table(
        f"streamed TTFT (ms), {TTFT_REPEATS} each, alternating",
        ["request", "median", "all"],
        [[k, v["median"], " ".join(f"{t:.0f}" for t in v["all"])] for k, v in result["ttft_ms"].items()],
    )
    return result


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8023)
    p.add_argument("--output", type=Path, default=ROOT / "bench/results/structured_output.json")
    p.add_argument("--skip-serve", action="store_true", help="only the compile and mask measurements")
    p.add_argument("--steps", type=int, default=200, help="timed mask steps per row count (default 200)")
    p.add_argument("--repeats", type=int, default=5, help="compiles per spec (default 5)")
    args = p.parse_args()
    config, source = create_engine_config(EngineArgs())
    vocab_size = config.model.vocab_size
    result: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {**machine(), "llguidance": llguidance.__version__},
        "model": config.model.model,
        "vocab_size": vocab_size,
    }
    print(f"model {result['model']} (vocab {vocab_size}) on {result['machine']['cpu']}")
    backend, result["compile"] = bench_compile(source, vocab_size, args.repeats)
    result["mask"] = bench_mask(backend, vocab_size, args.steps)
    if not args.skip_serve:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server
        server = Server(args.port, [], args.output.with_suffix(".serve.log"))
        try:
            server.wait_ready()
            model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            result["serve"] = asyncio.run(bench_serve(server.url, model))
        finally:
            server.stop()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
