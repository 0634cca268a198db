"""The one contract between `tokenmill bench compare` and an engine's driver: a JSON request in, a JSON result out.

Standard library only: each driver runs with its own engine's Python (a separate virtualenv without
tokenmill), imports this file as a sibling module, and calls `serve(drive)`:

    python ct2_driver.py request.json result.json

Every driver times its engine through one harness, `time_engine`: it loads the engine and weights
(`startup_s`, untimed), warms up with one short request (`warmup_s`, untimed), then runs each entry of
`request.runs` with all its requests submitted at once and times only that window. Output tokens are
counted from the ids the engine itself returned. A driver only says how to load its engine and generate.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class PeerPrompt:
    """One request: prompt token ids, a fixed number of output tokens (EOS ignored), a temperature."""

    prompt_token_ids: list[int]
    output_len: int
    temperature: float


@dataclass(frozen=True)
class PeerRequest:
    """What a driver is asked to do. `runs[i]` is one timed window's requests (repeats use distinct
    prompts, so no engine gains from a prefix cache warmed by the previous repeat)."""

    engine: str
    model: str  # HF folder (config.json, safetensors, tokenizer)
    dtype: str  # float32 | bfloat16 | int8
    threads: int
    seed: int
    runs: list[list[PeerPrompt]]
    weights: str | None = None  # an engine-specific converted copy of `model` (GGUF file, CTranslate2 folder)
    options: dict[str, Any] = field(default_factory=dict)  # engine-specific knobs (batch sizes, limits)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerRequest:
        data = json.loads(text)
        data["runs"] = [[PeerPrompt(**p) for p in run] for run in data["runs"]]
        return cls(**data)


@dataclass(frozen=True)
class RunResult:
    """One timed window. `variant` names a setting the driver swept (e.g. "batch 16"), else None."""

    num_requests: int
    prompt_tokens: int
    output_tokens: int  # returned ids, at most output_len per request
    elapsed_s: float
    generated_tokens: int | None = None  # ids computed, including any a static batch made and discarded
    variant: str | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class PeerResult:
    """What a driver reports; `error` is set (and `runs` may be empty) when it failed."""

    engine: str
    version: str | None = None
    startup_s: float = 0.0
    warmup_s: float = 0.0
    runs: list[RunResult] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # what the engine actually ran with
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> PeerResult:
        data = json.loads(text)
        data["runs"] = [RunResult(**r) for r in data.get("runs", [])]
        return cls(**data)


# Prompts in, the engine's output ids out (one list per prompt, in order), all prompts submitted at once.
Generate = Callable[[list[PeerPrompt]], list[list[int]]]


def count_run(
    prompts: list[PeerPrompt], outputs: list[list[int]], elapsed_s: float, variant: str | None = None
) -> RunResult:
    """A RunResult from the engine's returned ids (one list per prompt, in order), each capped at its
    request's output_len so ids a static batch made past a request's end are not counted."""
    if len(outputs) != len(prompts):
        raise RuntimeError(f"the engine returned {len(outputs)} outputs for {len(prompts)} prompts")
    counted = sum(min(len(ids), p.output_len) for p, ids in zip(prompts, outputs))
    return RunResult(
        num_requests=len(prompts),
        prompt_tokens=sum(len(p.prompt_token_ids) for p in prompts),
        output_tokens=counted,
        elapsed_s=elapsed_s,
        generated_tokens=sum(len(ids) for ids in outputs),
        variant=variant,
    )


def static_batches(prompts: list[PeerPrompt], batch_size: int) -> list[list[int]]:
    """Indices of `prompts` in batches of `batch_size`, sorted by output length, then prompt length."""
    order = sorted(range(len(prompts)), key=lambda i: (prompts[i].output_len, len(prompts[i].prompt_token_ids)))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def in_static_batches(generate_batch: Generate, batch_size: int) -> Generate:
    """`generate_batch` (one call per batch) over the `static_batches` of the prompts; outputs in prompt order."""

    def generate(prompts: list[PeerPrompt]) -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in prompts]
        for batch in static_batches(prompts, batch_size):
            for i, ids in zip(batch, generate_batch([prompts[i] for i in batch])):
                outputs[i] = ids
        return outputs

    return generate


def torch_cpu_capability() -> str:
    """The instruction set torch's CPU kernels dispatch to here ("AVX512", "AVX2", ...), for the report."""
    import torch

    return f"torch {torch.backends.cpu.get_cpu_capability()}"


WARMUP_PROMPT = PeerPrompt(prompt_token_ids=[7 + 13 * i for i in range(8)], output_len=4, temperature=0.0)


@dataclass
class Timing:
    elapsed: float = 0.0


@contextmanager
def stopwatch() -> Iterator[Timing]:
    """`with stopwatch() as t: ...`, then `t.elapsed` seconds."""
    timing, start = Timing(), time.perf_counter()
    try:
        yield timing
    finally:
        timing.elapsed = time.perf_counter() - start


Driver = Callable[[PeerRequest], PeerResult]


@dataclass(frozen=True)
class LoadedEngine:
    """What a driver's `load` returns to `time_engine`."""

    version: str
    generate: Generate  # for the warm-up, and for the runs when there are no variants
    # settings the driver sweeps, each timed as its own run, e.g. [("batch 16", generate_in_batches_of_16)]
    variants: list[tuple[str, Generate]] = field(default_factory=list)
    # what the engine ran with, read after the timed runs (it may inspect the engine)
    settings: Callable[[], dict[str, Any]] = dict
    notes: list[str] = field(default_factory=list)
    warmup_prompts: list[PeerPrompt] = field(default_factory=lambda: [WARMUP_PROMPT])


def time_engine(request: PeerRequest, load: Callable[[], LoadedEngine]) -> PeerResult:
    """The timing every driver shares: `load()` as startup_s (import the engine's modules and check the
    request before, so neither counts), the warm-up as warmup_s, then each run of `request.runs` (once per
    variant) with only its `generate` call inside the timed window."""
    with stopwatch() as startup:
        engine = load()
    with stopwatch() as warmup:
        engine.generate(engine.warmup_prompts)
    timed: list[tuple[str | None, Generate]] = [*engine.variants] or [(None, engine.generate)]
    runs = []
    for prompts in request.runs:
        for variant, generate in timed:
            with stopwatch() as window:
                outputs = generate(prompts)
            runs.append(count_run(prompts, outputs, window.elapsed, variant))
    return PeerResult(
        engine=request.engine,
        version=engine.version,
        startup_s=startup.elapsed,
        warmup_s=warmup.elapsed,
        runs=runs,
        settings=engine.settings(),
        notes=engine.notes,
    )


def serve(drive: Driver, argv: list[str] | None = None) -> int:
    """Entry point of every driver script: read the request file, run `drive`, write the result file.
    A failure is written as a result with `error` set (the traceback's tail), and exits 1."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: DRIVER request.json result.json", file=sys.stderr)
        return 2
    request_path, result_path = Path(args[0]), Path(args[1])
    request = PeerRequest.from_json(request_path.read_text())
    try:
        result = drive(request)
        code = 0
    except BaseException:  # noqa: BLE001 - any failure must reach the caller as a result
        result = PeerResult(engine=request.engine, error=traceback.format_exc()[-4000:])
        code = 1
    result_path.write_text(result.to_json())
    return code
