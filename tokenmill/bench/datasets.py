"""The standard benchmark workloads of docs/benchmarking.md, as synthetic token-id requests.

Every request runs to a fixed length (`ignore_eos`, `max_tokens=output_len`), so throughput does not depend
on the weights or on what the model happens to generate. A fixed seed gives the same requests every run.

    requests = make_workload("random-cpu", vocab_size=49152, seed=0)
    outputs = llm.generate([r.prompt for r in requests], [r.sampling_params() for r in requests])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenmill.sampling_params import SamplingParams

# Random prompts draw token ids below this (the nano-vllm protocol), or below the vocabulary if smaller.
MAX_TOKEN_ID = 10_000


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    temperature: float = 1.0

    @property
    def prompt(self) -> dict[str, list[int]]:
        """The form `LLM.generate` takes."""
        return {"prompt_token_ids": self.prompt_token_ids}

    @property
    def total_len(self) -> int:
        return len(self.prompt_token_ids) + self.output_len

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.output_len, temperature=self.temperature, ignore_eos=True)


# (rng, number of requests, token ids drawn below this) -> [(prompt, output_len)]
RequestSampler = Callable[[np.random.Generator, int, int], list[tuple[list[int], int]]]


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    description: str
    generate: RequestSampler
    temperature: float = 1.0


def _tokens(rng: np.random.Generator, n: int, high: int) -> list[int]:
    return rng.integers(0, high, size=n).tolist()


def _uniform(prompt: tuple[int, int], output: tuple[int, int]) -> RequestSampler:
    def generate(rng: np.random.Generator, n: int, high: int) -> list[tuple[list[int], int]]:
        prompt_lens = rng.integers(prompt[0], prompt[1] + 1, size=n)
        output_lens = rng.integers(output[0], output[1] + 1, size=n)
        return [(_tokens(rng, int(p), high), int(o)) for p, o in zip(prompt_lens, output_lens)]

    return generate


def _fixed(prompt_len: int, output_len: int) -> RequestSampler:
    return _uniform((prompt_len, prompt_len), (output_len, output_len))


def _lognormal_lengths(
    rng: np.random.Generator, n: int, mean: float, sigma: float, low: int, high: np.ndarray | int
) -> np.ndarray:
    """Right-skewed lengths whose untruncated mean is `mean`, clipped to [low, high]."""
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), low, high).astype(int)


def _sharegpt_like(rng: np.random.Generator, n: int, high: int) -> list[tuple[list[int], int]]:
    # ShareGPT (as vLLM samples it): prompts mean ~226 tokens, outputs mean ~199, both long-tailed.
    prompt_lens = _lognormal_lengths(rng, n, 226, 0.9, 4, 1024)
    output_lens = _lognormal_lengths(rng, n, 199, 1.0, 4, 2048 - prompt_lens)
    return [(_tokens(rng, int(p), high), int(o)) for p, o in zip(prompt_lens, output_lens)]


SHARED_PREFIX_LEN = 1024
SHARED_UNIQUE_LEN = 64


def _shared_prefix(rng: np.random.Generator, n: int, high: int) -> list[tuple[list[int], int]]:
    prefix = _tokens(rng, SHARED_PREFIX_LEN, high)
    return [(prefix + _tokens(rng, SHARED_UNIQUE_LEN, high), 128) for _ in range(n)]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "random-cpu",
            64,
            "prompt 64-512, output 32-256, uniform (nano-vllm protocol, CPU size)",
            _uniform((64, 512), (32, 256)),
            temperature=0.6,
        ),
        Workload(
            "random-gpu",
            256,
            "prompt 100-1024, output 100-1024, uniform (nano-vllm protocol)",
            _uniform((100, 1024), (100, 1024)),
            temperature=0.6,
        ),
        Workload(
            "sharegpt-like", 256, "log-normal: prompt mean ~226 (<= 1024), output ~199, total <= 2048", _sharegpt_like
        ),
        Workload("shared-prefix", 64, "1024-token shared prefix + 64 unique tokens, 128 out", _shared_prefix),
        Workload("fixed-1024-128", 64, "prompt 1024, output 128 (prefill-heavy)", _fixed(1024, 128)),
        Workload("fixed-128-1024", 64, "prompt 128, output 1024 (decode-heavy)", _fixed(128, 1024)),
    ]
}


def make_workload(
    name: str,
    vocab_size: int,
    seed: int = 0,
    num_requests: int | None = None,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
) -> list[BenchRequest]:
    """The requests of a standard workload; the same for the same arguments, every run.

    `num_requests` overrides the workload's count. `max_prompt_len` keeps only the last tokens of longer
    prompts (so shared-prefix prompts stay distinct and still share what is left of the prefix);
    `max_output_len` caps the output lengths. Both exist to fit a model with a short context."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; use one of {', '.join(WORKLOADS)}.")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
    for flag, value in (
        ("num_requests", num_requests),
        ("max_prompt_len", max_prompt_len),
        ("max_output_len", max_output_len),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}.")
    workload = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    pairs = workload.generate(rng, num_requests or workload.num_requests, min(MAX_TOKEN_ID, vocab_size))
    return [
        BenchRequest(
            prompt_token_ids=prompt[-max_prompt_len:] if max_prompt_len else prompt,
            output_len=min(output_len, max_output_len) if max_output_len else output_len,
            temperature=workload.temperature,
        )
        for prompt, output_len in pairs
    ]


def check_fits(requests: list[BenchRequest], max_model_len: int) -> None:
    """Raise a ValueError that says how to fit when some request needs more than `max_model_len` tokens."""
    longest = max((r.total_len for r in requests), default=0)
    if longest > max_model_len:
        raise ValueError(
            f"the workload has a request of {longest} tokens (prompt + output) but max_model_len is "
            f"{max_model_len}; raise --max-model-len if the model allows, or cap the workload with "
            f"--max-prompt-len / --max-output-len."
        )
