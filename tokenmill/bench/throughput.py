"""Offline throughput: run a workload through `LLM.generate` and measure it (docs/benchmarking.md's metrics).

Continuous batching submits every request in one `generate` call and lets the scheduler refill the
batch as requests finish. Static batching runs the same engine on fixed batches of `batch_size`
requests, each finishing completely before the next starts: the baseline continuous batching beats.

    result = run_throughput(llm, make_workload("random-cpu", llm.config.model.vocab_size))
    print(result.output_tok_s)
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.bench.datasets import BenchRequest
from tokenmill.lora_request import LoRARequest
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM
    from tokenmill.outputs import RequestOutput


@dataclass
class ThroughputResult:
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # counted from the token ids the engine returned
    elapsed_s: float
    requests_per_s: float
    output_tok_s: float
    total_tok_s: float  # (prompt + output) tokens / elapsed
    # Tokens sampled by steps that ran only decode rows / those steps' wall time: the decode rate
    # without the prefills (0 when no step was decode only).
    decode_tok_s: float
    kv_slot_utilization: float  # real tokens / allocated KV slots, averaged over the timed steps
    prefix_cache_hit_rate: float  # prompt tokens found in the prefix cache / prompt tokens looked up
    num_preemptions: int
    num_steps: int
    static_batching: bool
    batch_size: int | None  # requests per batch with static batching; None for continuous
    # sha256 of each request's generated text (its first sample), in request order, and of them all: a
    # script compares these across runs (greedy texts must not change when speculation is on).
    output_text_sha256: list[str]
    outputs_sha256: str
    # Speculative decoding over the timed window (all 0 when off): request-steps that verified drafts,
    # draft tokens verified, and those accepted.
    speculative: bool = False
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / draft tokens."""
        return _ratio(self.spec_num_accepted_tokens, self.spec_num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step, the target's own token included: 1 + accepted / drafts (vLLM's)."""
        return 1.0 + _ratio(self.spec_num_accepted_tokens, self.spec_num_drafts)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.speculative:
            data["acceptance_rate"] = self.acceptance_rate
            data["mean_accepted_length"] = self.mean_accepted_length
        return data


@dataclass(frozen=True)
class _EngineCounters:
    """Cumulative engine counters at one moment; the difference of two is the timed window's."""

    num_steps: int
    num_preemptions: int
    kv_slots_used: int
    kv_slots_allocated: int
    prefix_queries: int
    prefix_hits: int
    decode_tokens: int
    decode_seconds: float
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int

    @classmethod
    def read(cls, llm: LLM) -> _EngineCounters:
        sched, cache, decode = llm.engine.scheduler.stats, llm.engine.kv_cache.stats, llm.engine.decode_stats
        return cls(
            sched.num_steps,
            sched.num_preemptions,
            sched.kv_slots_used,
            sched.kv_slots_allocated,
            cache.queries,
            cache.hits,
            decode.tokens,
            decode.seconds,
            sched.spec.num_drafts,
            sched.spec.num_draft_tokens,
            sched.spec.num_accepted_tokens,
        )

    def __sub__(self, other: _EngineCounters) -> _EngineCounters:
        return _EngineCounters(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))


def warm_up(llm: LLM) -> None:
    """One short request, so one-time costs (allocation, lazy init, compilation) stay out of the timing.
    Its 8-token prompt fills no block of the default size (16), so it seeds no prefix-cache entry."""
    vocab = llm.config.model.vocab_size
    prompt = [(7 + 13 * i) % vocab for i in range(8)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)


def run_throughput(
    llm: LLM,
    requests: list[BenchRequest],
    static_batching: bool = False,
    batch_size: int | None = None,
    *,
    warmup: bool = True,
    use_tqdm: bool = False,
    lora_requests: list[LoRARequest | None] | None = None,
) -> ThroughputResult:
    """Warm up (untimed), then generate every request and measure the timed window only. `lora_requests`:
    each request's LoRA adapter (None: the base model for all).

    With `static_batching`, requests go in fixed batches of `batch_size` (default: the engine's
    max_num_seqs), one `generate` call each, with no refill until the whole batch has finished."""
    if not requests:
        raise ValueError("the workload has no requests.")
    if batch_size is None:
        batch_size = llm.config.scheduler.max_num_seqs
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    prompts = [r.prompt for r in requests]
    params = [r.sampling_params() for r in requests]
    step = batch_size if static_batching else len(requests)
    if warmup:
        warm_up(llm)

    before = _EngineCounters.read(llm)
    start = time.perf_counter()
    outputs: list[RequestOutput] = []
    for i in range(0, len(requests), step):
        loras = lora_requests[i : i + step] if lora_requests is not None else None
        outputs += llm.generate(prompts[i : i + step], params[i : i + step], use_tqdm=use_tqdm, lora_request=loras)
    elapsed = time.perf_counter() - start
    delta = _EngineCounters.read(llm) - before

    failed = [o for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outputs)} requests failed; first: {failed[0].error}")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    text_hashes = [hashlib.sha256(o.outputs[0].text.encode()).hexdigest() for o in outputs]
    return ThroughputResult(
        num_requests=len(outputs),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        elapsed_s=elapsed,
        requests_per_s=len(outputs) / elapsed,
        output_tok_s=output_tokens / elapsed,
        total_tok_s=(prompt_tokens + output_tokens) / elapsed,
        decode_tok_s=delta.decode_tokens / delta.decode_seconds if delta.decode_seconds else 0.0,
        kv_slot_utilization=_ratio(delta.kv_slots_used, delta.kv_slots_allocated),
        prefix_cache_hit_rate=_ratio(delta.prefix_hits, delta.prefix_queries),
        num_preemptions=delta.num_preemptions,
        num_steps=delta.num_steps,
        static_batching=static_batching,
        batch_size=batch_size if static_batching else None,
        output_text_sha256=text_hashes,
        outputs_sha256=hashlib.sha256("".join(text_hashes).encode()).hexdigest(),
        speculative=llm.config.speculative is not None,
        spec_num_drafts=delta.spec_drafts,
        spec_num_draft_tokens=delta.spec_draft_tokens,
        spec_num_accepted_tokens=delta.spec_accepted_tokens,
    )


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0
