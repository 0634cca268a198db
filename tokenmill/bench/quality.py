"""How much a quantized model differs from the unquantized one: greedy agreement and perplexity.

    tokenmill bench quality --quantization int8
    tokenmill bench quality --quantization int4 --quantization-group-size 128
    tokenmill bench quality --quantization gguf        # a .gguf's own blocks against its bf16 expansion

Both numbers come from the engine itself (`LLM.generate`), so they measure what users get:
greedy agreement over fixed prompts (the fraction of identical tokens up to each prompt's first
divergence, and position by position overall), and perplexity on a fixed English text
(`quality_text.QUALITY_TEXT`) from its prompt logprobs."""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.quality_text import QUALITY_TEXT

QUALITY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three most important things to remember when learning to swim are",
    "Photosynthesis is the process by which",
    "Here is a short poem about autumn:\n",
    "To make a cup of tea, first",
    "The main difference between a virus and a bacterium is",
    "def fibonacci(n):\n",
    "The history of the Roman Empire began",
    "My favourite thing about weekends is",
    "Water boils at 100 degrees Celsius because",
    "A good way to start a job interview is",
    "The planets of the solar system, in order from the sun, are",
    "In the year 2050, cities will",
    "The recipe for a simple tomato soup:",
    "Dear customer, thank you for your order.",
    "The most common mistake new programmers make is",
    "Machine learning is a field of computer science that",
    "The train left the station at exactly",
    "Five tips for getting a good night's sleep:\n1.",
]


@dataclass(frozen=True)
class Agreement:
    num_prompts: int
    num_tokens: int  # reference tokens compared
    prefix_fraction: float  # tokens before each prompt's first divergence / all tokens
    overall_fraction: float  # identical tokens at the same position / all tokens
    num_identical: int  # prompts whose whole continuation matches


@dataclass(frozen=True)
class QualityReport:
    quantization: str  # of the candidate, with its kv_cache_dtype where not "auto"
    agreement: Agreement
    ppl_reference: float
    ppl_quantized: float

    @property
    def ppl_relative_diff(self) -> float:
        return self.ppl_quantized / self.ppl_reference - 1.0


def greedy_tokens(llm: Any, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(list(prompts), params, use_tqdm=False)]


def greedy_agreement(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> Agreement:
    total = prefix = same = identical = 0
    for ref, cand in zip(reference, candidate, strict=True):
        matches = [a == b for a, b in zip(ref, cand)] + [False] * (len(ref) - len(cand))
        first_diff = matches.index(False) if False in matches else len(ref)
        total += len(ref)
        prefix += first_diff
        same += sum(matches)
        identical += first_diff == len(ref)
    return Agreement(len(reference), total, prefix / max(total, 1), same / max(total, 1), identical)


def perplexity(llm: Any, text: str = QUALITY_TEXT) -> float:
    """exp(mean negative log-likelihood) of the text's tokens after the first."""
    from tokenmill import SamplingParams

    ids = llm.get_tokenizer().encode(text)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    entries = out[0].prompt_logprobs or []
    nll = [-entry[token].logprob for token, entry in zip(ids, entries) if entry is not None]
    if not nll:
        raise RuntimeError("the engine returned no prompt logprobs for the perplexity text")
    return math.exp(sum(nll) / len(nll))


def run_quality(
    model: str | None,
    quantization: str,
    num_prompts: int = 20,
    max_tokens: int = 64,
    kv_cache_dtype: str = "auto",
    **engine_kwargs: Any,
) -> QualityReport:
    """Build the unquantized engine (KV cache dtype auto), then the quantized one with `kv_cache_dtype`
    (one at a time, to bound memory), and compare."""
    from tokenmill import LLM

    prompts = QUALITY_PROMPTS[:num_prompts]
    # the method's own settings (int4's group size and zero point) go to the quantized engine only
    options = {
        k: engine_kwargs.pop(k) for k in ("quantization_group_size", "quantization_zero_point") if k in engine_kwargs
    }
    results = []
    for quant, kv, extra in ((None, "auto", {}), (quantization, kv_cache_dtype, options)):
        llm = LLM(model, quantization=quant, kv_cache_dtype=kv, **engine_kwargs, **extra)
        results.append((greedy_tokens(llm, prompts, max_tokens), perplexity(llm)))
        del llm
        gc.collect()
    (ref_tokens, ref_ppl), (q_tokens, q_ppl) = results
    label = "gguf (the file's own blocks)" if quantization == "gguf" else quantization
    if options.get("quantization_group_size"):
        label += f" groups of {options['quantization_group_size']}"
    if options.get("quantization_zero_point"):
        label += " with minimums"
    if kv_cache_dtype != "auto":
        label += f", KV cache {kv_cache_dtype}"
    return QualityReport(label, greedy_agreement(ref_tokens, q_tokens), ref_ppl, q_ppl)


def format_report(report: QualityReport) -> str:
    a = report.agreement
    rows = [
        ("greedy agreement", f"{a.num_prompts} prompts x {a.num_tokens // max(a.num_prompts, 1)} tokens"),
        ("  up to first divergence", f"{a.prefix_fraction:.1%}"),
        ("  overall (same position)", f"{a.overall_fraction:.1%}"),
        ("  identical continuations", f"{a.num_identical} / {a.num_prompts}"),
        ("perplexity (unquantized)", f"{report.ppl_reference:.4f}"),
        (f"perplexity ({report.quantization})", f"{report.ppl_quantized:.4f}"),
        ("relative difference", f"{report.ppl_relative_diff:+.2%}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


# ---------------------------------------------------------------------- tokenmill bench quality
def add_quality_parser(subparsers: Any) -> None:
    """Register `tokenmill bench quality` on the `bench` subparsers."""
    from tokenmill.engine.engine_args import add_engine_args

    parser = subparsers.add_parser(
        "quality",
        help="a quantized model against the unquantized one: greedy agreement and perplexity",
        description="Greedy agreement (20 prompts x 64 tokens, up to the first divergence and overall) and "
        "perplexity on a fixed English text, for the model with and without --quantization (default int8). "
        "--kv-cache-dtype applies to the quantized engine (the reference keeps auto): int8 measures "
        "int8 weights with an int8 KV cache. --quantization gguf serves a .gguf model (default: the embedded "
        "Q4_1) in its own blocks against its bf16 expansion.",
    )
    add_engine_args(parser)
    parser.set_defaults(quantization="int8")
    parser.add_argument("--num-prompts", type=int, default=len(QUALITY_PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.set_defaults(func=cmd_quality)


def cmd_quality(args: Any) -> None:
    from tokenmill.engine.engine_args import engine_kwargs

    kwargs = engine_kwargs(args)
    quantization = kwargs.pop("quantization")
    if quantization is None:
        raise ValueError("bench quality compares a quantized model with the unquantized one: give --quantization.")
    kv_cache_dtype = kwargs.pop("kv_cache_dtype", "auto")
    report = run_quality(args.model, quantization, args.num_prompts, args.max_tokens, kv_cache_dtype, **kwargs)
    print(f"\n{report.quantization} against the unquantized model ({args.model or 'the embedded default model'}):")
    print(format_report(report))
