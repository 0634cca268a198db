"""`tokenmill bench compare`: the same requests through tokenmill and each peer engine, in one run.

Every engine runs in its own subprocess through a driver (peers/drivers/): tokenmill with our Python, each
peer with its own virtualenv's. Each gets the same HF weights (converted where it needs its own format),
the same precision, the same requests, all submitted at once with a fixed output length, and reports the
median of `repeat` timed windows (repeat r uses the workload drawn with seed + r, so no engine reuses a
prefix cache from the previous repeat). The machine's roofline is measured in the same run.

    opts = CompareOptions(workload="random-cpu", peers=["vllm", "hf"], repeat=3)
    report = run_compare(opts)
    print(format_table(report))
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenmill.bench.datasets import BenchRequest, check_fits, make_workload
from tokenmill.bench.peers import PEERS, is_set_up, not_set_up_note, peer_root, run_driver
from tokenmill.bench.peers.base import venv_python
from tokenmill.bench.peers.drivers.peer_protocol import PeerPrompt, PeerRequest, PeerResult, RunResult
from tokenmill.bench.peers.isa import AVX2_ENV, CPU_ISAS
from tokenmill.bench.roofline import MachineRates, ModelShape, Roofline, compute_fraction, decode_roofline, fraction_of

TOKENMILL = "tokenmill"
DTYPES = ("float32", "bfloat16", "int8", "q4_0", "q4_1")  # q4_*: tokenmill int4 (groups of 32)
FLOAT_DTYPES = ("float32", "bfloat16")
PEER_DTYPE_CHOICES = ("same", "best")


@dataclass(frozen=True)
class CompareOptions:
    workload: str = "random-cpu"
    peers: list[str] = field(default_factory=list)
    model: str | None = None  # HF folder, preset name, or None for the embedded model
    dtype: str = "auto"  # auto | float32 | bfloat16 | int8
    peer_dtype: str = "same"  # "same": peers run `dtype`; "best": each float dtype a peer has, its fastest kept
    num_prompts: int | None = None
    max_prompt_len: int | None = None
    max_output_len: int | None = None
    repeat: int = 3
    seed: int = 0
    threads: int = 2
    max_num_seqs: int | None = None  # for the continuously batching engines (tokenmill, vllm, llamacpp)
    timeout_s: float = 3600.0  # per engine, its repeats included
    include_tokenmill: bool = True
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per engine, for its driver
    # "avx2": every engine restricted to AVX2 (peers/isa.py); this process too, which the caller arranges
    # (os.environ.update(AVX2_ENV) before torch runs anything: the CLI does) so the roofline matches
    cpu_isa: str = "native"


@dataclass
class EngineSummary:
    """One engine's line of the table: medians over the repeats of its best variant."""

    engine: str
    status: str  # ok | skipped | failed
    note: str = ""
    version: str | None = None
    variant: str | None = None  # e.g. "batch 16", the best of those an engine swept
    output_tok_s: float = 0.0
    total_tok_s: float = 0.0
    requests_per_s: float = 0.0
    elapsed_s: float = 0.0
    startup_s: float = 0.0
    ratio_to_tokenmill: float | None = None  # this engine's output tok/s / tokenmill's
    roofline_fraction: float | None = None  # output tok/s / decode ceiling
    compute_fraction: float | None = None  # matmul FLOP/s of prompt + output tokens / peak GEMM FLOP/s
    runs: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class CompareReport:
    options: dict[str, Any]
    model_folder: str
    dtype: str
    num_requests: int
    rates: MachineRates | None
    roofline: Roofline | None
    engines: list[EngineSummary]

    def to_dict(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "model_folder": self.model_folder,
            "dtype": self.dtype,
            "num_requests": self.num_requests,
            "rates": asdict(self.rates) if self.rates else None,
            "roofline": self.roofline.to_dict() if self.roofline else None,
            "engines": [asdict(e) for e in self.engines],
        }


def resolve_compare_dtype(dtype: str) -> str:
    """auto means what tokenmill picks on this machine for the compared (16-bit) checkpoint: bf16 weights,
    with bf16 arithmetic where the CPU has it, widened to float32 in registers elsewhere."""
    from tokenmill.loader.model_source import resolve_dtype

    if dtype in ("int8", "q4_0", "q4_1"):
        return dtype
    resolved = resolve_dtype(dtype, "cpu", "bfloat16")
    if resolved not in DTYPES:
        raise ValueError(f"compare runs {', '.join(DTYPES)} (or auto), not {dtype!r}.")
    return resolved


def to_prompts(requests: list[BenchRequest]) -> list[PeerPrompt]:
    return [PeerPrompt(list(r.prompt_token_ids), r.output_len, r.temperature) for r in requests]


def summarize(result: PeerResult, expected_output_tokens: list[int]) -> EngineSummary:
    """The table line for a driver's result: its best variant by median output tok/s, or the failure.
    `expected_output_tokens[r]` is repeat r's total (each repeat draws its own requests); a variant's
    runs come in repeat order."""
    if result.error is not None:
        last = result.error.strip().splitlines()[-1] if result.error.strip() else "failed"
        return EngineSummary(result.engine, "failed", note=last[:200], version=result.version, error=result.error)
    if not result.runs:
        return EngineSummary(result.engine, "failed", note="the driver returned no runs", version=result.version)
    by_variant: dict[str | None, list[RunResult]] = {}
    for run in result.runs:
        by_variant.setdefault(run.variant, []).append(run)
    variant, runs = max(by_variant.items(), key=lambda kv: statistics.median(r.output_tok_s for r in kv[1]))
    notes = list(result.notes)
    if len(by_variant) > 1:
        medians = ", ".join(f"{v}: {statistics.median(r.output_tok_s for r in rs):.0f}" for v, rs in by_variant.items())
        notes.insert(0, f"best of {medians} output tok/s")
    short = [(r.output_tokens, want) for r, want in zip(runs, expected_output_tokens) if r.output_tokens < want]
    if short:
        notes.insert(0, f"WARNING: produced {short[0][0]} of {short[0][1]} output tokens")
    return EngineSummary(
        engine=result.engine,
        status="ok",
        note="; ".join(notes),
        version=result.version,
        variant=variant,
        output_tok_s=statistics.median(r.output_tok_s for r in runs),
        total_tok_s=statistics.median(r.total_tok_s for r in runs),
        requests_per_s=statistics.median(r.num_requests / r.elapsed_s for r in runs),
        elapsed_s=statistics.median(r.elapsed_s for r in runs),
        startup_s=result.startup_s,
        runs=[asdict(r) for r in result.runs],
        settings=result.settings,
    )


def add_ratios(
    engines: list[EngineSummary], roofline: Roofline | None, shape: ModelShape | None, rates: MachineRates | None
) -> None:
    """Fill ratio_to_tokenmill and the roofline fractions of every engine that ran."""
    base = next((e.output_tok_s for e in engines if e.engine == TOKENMILL and e.status == "ok"), None)
    for e in engines:
        if e.status != "ok":
            continue
        e.ratio_to_tokenmill = e.output_tok_s / base if base else None
        if roofline is not None:
            e.roofline_fraction = fraction_of(e.output_tok_s, roofline.ceiling_tok_s)
        if shape is not None and rates is not None:
            e.compute_fraction = compute_fraction(shape, rates, e.total_tok_s - e.output_tok_s, e.output_tok_s)


def _pct(x: float | None) -> str:
    return f"{x:.0%}" if x is not None else "-"


def format_table(report: CompareReport) -> str:
    header = (
        "engine",
        "version",
        "output tok/s",
        "total tok/s",
        "req/s",
        "ratio to tokenmill",
        "of roofline",
        "of compute",
        "note",
    )
    rows = [header]
    for e in report.engines:
        if e.status != "ok":
            rows.append((e.engine, e.version or "", "-", "-", "-", "-", "-", "-", f"{e.status.upper()}: {e.note}"))
            continue
        rows.append(
            (
                e.engine,
                e.version or "",
                f"{e.output_tok_s:.1f}",
                f"{e.total_tok_s:.1f}",
                f"{e.requests_per_s:.2f}",
                f"{e.ratio_to_tokenmill:.2f}x" if e.ratio_to_tokenmill is not None else "-",
                _pct(e.roofline_fraction),
                _pct(e.compute_fraction),
                "; ".join(x for x in (e.variant or "", e.note) if x),
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * (sum(widths) + 2 * len(widths) + 4))
    isa = [f"{e.engine}: {e.settings['isa']}" for e in report.engines if e.status == "ok" and e.settings.get("isa")]
    if isa:
        emulated = " (AVX2 forced on every engine: --cpu-isa avx2)" if report.options.get("cpu_isa") == "avx2" else ""
        lines.append(f"instruction-set paths{emulated}: " + " | ".join(isa))
    tm = next((e for e in report.engines if e.engine == TOKENMILL and e.status == "ok"), None)
    if tm:
        for e in report.engines:
            if e.status == "ok" and e is not tm and e.output_tok_s > 0:
                lines.append(f"tokenmill / {e.engine}: {tm.output_tok_s / e.output_tok_s:.2f}x output tok/s")
    return "\n".join(lines)


def plot(report: CompareReport, path: Path) -> str:
    """A bar chart of output tok/s per engine with the decode ceiling; returns what happened, in words."""
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        return "no plot: matplotlib is missing (pip install 'tokenmill[plot]')"
    ran = [e for e in report.engines if e.status == "ok"]
    fig, ax = plt.subplots(figsize=(1.6 * max(len(ran), 3) + 2, 4.5))
    bars = ax.bar(
        [e.engine for e in ran],
        [e.output_tok_s for e in ran],
        color=["#d62728" if e.engine == TOKENMILL else "#1f77b4" for e in ran],
    )
    ax.bar_label(bars, labels=[f"{e.output_tok_s:.0f}" for e in ran])
    if report.roofline:
        ax.axhline(
            report.roofline.ceiling_tok_s,
            color="gray",
            linestyle="--",
            label=f"decode roofline {report.roofline.ceiling_tok_s:.0f} tok/s ({report.roofline.bound})",
        )
        ax.legend(loc="upper right")
    top = max([e.output_tok_s for e in ran] + [report.roofline.ceiling_tok_s if report.roofline else 0.0])
    ax.set_ylim(0, 1.25 * top if top > 0 else 1.0)
    workload = report.options.get("workload")
    ax.set_title(
        f"{workload}, {Path(report.model_folder).name}, {report.dtype}: output tok/s "
        f"(median of {report.options.get('repeat')})"
    )
    ax.set_ylabel("output tokens / s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def run_compare(opts: CompareOptions, log: Callable[[str], None] = print) -> CompareReport:
    """Measure the roofline, then run tokenmill and each set-up peer on the same requests."""
    from tokenmill.bench.model_folder import read_config, resolve_model_folder
    from tokenmill.bench.roofline import format_roofline, measure_rates

    if opts.repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {opts.repeat}.")
    if opts.peer_dtype not in PEER_DTYPE_CHOICES:
        raise ValueError(f"peer_dtype must be one of {PEER_DTYPE_CHOICES}, not {opts.peer_dtype!r}.")
    check_cpu_isa(opts.cpu_isa)
    unknown = [p for p in opts.peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; peers: {', '.join(PEERS)}.")
    dtype = resolve_compare_dtype(opts.dtype)
    folder = resolve_model_folder(opts.model, opts.seed)
    config = read_config(folder)
    runs = [
        make_workload(
            opts.workload,
            int(config["vocab_size"]),
            seed=opts.seed + r,
            num_requests=opts.num_prompts,
            max_prompt_len=opts.max_prompt_len,
            max_output_len=opts.max_output_len,
        )
        for r in range(opts.repeat)
    ]
    for requests in runs:
        check_fits(requests, int(config.get("max_position_embeddings") or 4096))
    expected = [sum(r.output_len for r in requests) for requests in runs]

    shape = ModelShape.from_hf_config(config)
    batch = min(len(runs[0]), opts.max_num_seqs or 64)
    avg_context = statistics.mean(len(r.prompt_token_ids) + r.output_len / 2 for r in runs[0])
    log("measuring the roofline ...")
    rates = measure_rates(shape, dtype, batch, opts.threads)
    kv_dtype = "float32" if dtype == "float32" else "bfloat16"  # 16-bit KV: ours (kv_cache_dtype auto) and the peers'
    roofline = decode_roofline(shape, rates, batch, avg_context, weight_dtype=dtype, kv_dtype=kv_dtype)
    log(format_roofline(rates, roofline))

    base = PeerRequest(
        engine="",
        model=str(folder),
        dtype=dtype,
        threads=opts.threads,
        seed=opts.seed,
        runs=[to_prompts(r) for r in runs],
    )
    engines = ([TOKENMILL] if opts.include_tokenmill else []) + list(opts.peers)
    summaries = []
    for name in engines:
        log(f"running {name} ...")
        summary = _run_engine(name, base, opts, expected, log)
        log(f"  {name}: {summary.status} {summary.output_tok_s:.1f} output tok/s {summary.note}")
        summaries.append(summary)
    add_ratios(summaries, roofline, shape, rates)
    return CompareReport(asdict(opts), str(folder), dtype, len(runs[0]), rates, roofline, summaries)


def _run_engine(
    name: str, base: PeerRequest, opts: CompareOptions, expected: list[int], log: Callable[[str], None]
) -> EngineSummary:
    options = dict(opts.engine_options.get(name, {}))
    if opts.max_num_seqs and name in (TOKENMILL, "vllm", "llamacpp"):
        options.setdefault("max_num_seqs", opts.max_num_seqs)
    isa_env = AVX2_ENV if opts.cpu_isa == "avx2" else {}
    if name == TOKENMILL:
        request = replace(base, engine=name, options=options)
        # The project's own Python; the repo root on the path in case tokenmill is not installed.
        env = {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")])),
            **isa_env,
        }
        result = run_driver(name, sys.executable, "tokenmill_driver.py", request, env=env, timeout_s=opts.timeout_s)
        return summarize(result, expected)
    spec = PEERS[name]
    if not is_set_up(name):
        return EngineSummary(name, "skipped", note=not_set_up_note(name))
    if opts.peer_dtype == "best" and base.dtype in FLOAT_DTYPES:
        # Each engine at the setting its users would pick on this CPU (vLLM's CPU backend, for one, is
        # fastest in float32 where the CPU lacks bf16 arithmetic): every float dtype it runs, the fastest kept.
        tried = [
            _run_engine(name, replace(base, dtype=d), replace(opts, peer_dtype="same"), expected, log)
            for d in FLOAT_DTYPES
            if d in spec.dtypes
        ]
        return best_dtype(tried, [d for d in FLOAT_DTYPES if d in spec.dtypes])
    if base.dtype not in spec.dtypes:
        note = f"{name} has no {base.dtype} here (it runs {', '.join(spec.dtypes)})"
        return EngineSummary(name, "skipped", note=note)
    root = peer_root(name)
    try:
        weights = spec.prepare_weights(root, Path(base.model), base.dtype)
        env = {**spec.driver_env(opts.threads), **isa_env, **(spec.avx2_env(root) if isa_env else {})}
    except RuntimeError as exc:
        return EngineSummary(
            name, "failed", note=f"preparing {name} failed: {str(exc).splitlines()[0]}", error=str(exc)
        )
    request = replace(base, engine=name, options=options, weights=str(weights) if weights else None)
    result = run_driver(name, venv_python(root), spec.driver, request, env=env, timeout_s=opts.timeout_s)
    return summarize(result, expected)


def check_cpu_isa(cpu_isa: str) -> None:
    """Raises ValueError unless `cpu_isa` is one of CPU_ISAS and this CPU runs it."""
    from tokenmill.ops.build import cpu_has_avx2

    if cpu_isa not in CPU_ISAS:
        raise ValueError(f"cpu_isa must be one of {CPU_ISAS}, not {cpu_isa!r}.")
    if cpu_isa == "avx2" and not cpu_has_avx2():
        raise ValueError("cpu_isa='avx2' needs a CPU with AVX2 and FMA; this one lacks them.")


def best_dtype(tried: list[EngineSummary], dtypes: list[str]) -> EngineSummary:
    """The fastest of one engine's runs at several dtypes (`tried[i]` ran `dtypes[i]`), noting the others."""
    ok = [(s, d) for s, d in zip(tried, dtypes) if s.status == "ok"]
    if not ok:
        return tried[0]
    best, dtype = max(ok, key=lambda sd: sd[0].output_tok_s)
    others = ", ".join(
        f"{d}: {s.output_tok_s:.1f}" if s.status == "ok" else f"{d}: {s.status}" for s, d in zip(tried, dtypes)
    )
    return replace(best, note="; ".join(x for x in (f"best dtype {dtype} ({others} output tok/s)", best.note) if x))
