"""The standard benchmark workloads of docs/benchmarking.md, as token-id requests.

The random workloads are synthetic token ids, and every request runs to a fixed length (`ignore_eos`,
`max_tokens=output_len`), so throughput does not depend on the weights or on what the model happens to
generate. `copy-edit` is text through the model's chat template (it needs the tokenizer): greedy requests
whose answers copy most of the prompt (copy_edit.py), ending at the model's end of turn. A fixed seed
gives the same requests every run.

    requests = make_workload("random-cpu", vocab_size=49152, seed=0)
    requests = make_workload("copy-edit", vocab_size=49152, seed=0, tokenizer=llm.get_tokenizer())
    outputs = llm.generate([r.prompt for r in requests], [r.sampling_params() for r in requests])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from tokenmill.bench.copy_edit import ChatTask, copy_edit_tasks
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Random prompts draw token ids below this (the nano-vllm protocol), or below the vocabulary if smaller.
MAX_TOKEN_ID = 10_000


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    temperature: float = 1.0
    ignore_eos: bool = True  # False: the request may end early, at the model's end of turn

    @property
    def prompt(self) -> dict[str, list[int]]:
        """The form `LLM.generate` takes."""
        return {"prompt_token_ids": self.prompt_token_ids}

    @property
    def total_len(self) -> int:
        return len(self.prompt_token_ids) + self.output_len

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.output_len, temperature=self.temperature, ignore_eos=self.ignore_eos)


# (rng, number of requests, token ids drawn below this) -> [(prompt, output_len)]
RequestSampler = Callable[[np.random.Generator, int, int], list[tuple[list[int], int]]]
# (rng, number of requests) -> chat tasks, templated and tokenized by make_workload
ChatSampler = Callable[[np.random.Generator, int], list[ChatTask]]


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    description: str
    generate: RequestSampler | None = None
    temperature: float = 1.0
    chat: ChatSampler | None = None  # a text workload: needs the model's tokenizer
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if (self.generate is None) == (self.chat is None):
            raise ValueError(f"workload {self.name!r} needs exactly one of generate (token ids) and chat (text).")


# copy-edit: the answer's tokens plus room for a short preamble ("Here is the corrected text:"), and a
# bound that keeps prompt + output within 1,024 tokens.
COPY_EDIT_OUTPUT_MARGIN = 16
COPY_EDIT_MAX_OUTPUT = 256


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
        Workload(
            "copy-edit",
            16,
            "chat: repeat, correct typos, rename a variable, convert a list; answers copy the prompt "
            "(~100-250 prompt tokens, output <= 256, greedy, stops at end of turn; needs the tokenizer)",
            chat=copy_edit_tasks,
            temperature=0.0,
            ignore_eos=False,
        ),
    ]
}

# The workloads of token ids only (no tokenizer needed): what tools that send raw ids to peers or servers take.
TOKEN_WORKLOADS = [name for name, w in WORKLOADS.items() if w.chat is None]


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, message: str) -> list[int]:
    """One user message through the tokenizer's chat template, ready for the assistant's reply; a
    tokenizer without a template (a base model) gets a plain "User: / Assistant:" transcript."""
    messages = [{"role": "user", "content": message}]
    if getattr(tokenizer, "chat_template", None):
        text = cast(str, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(f"User: {message}\n\nAssistant:", add_special_tokens=True))


def _chat_requests(tasks: list[ChatTask], tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], int]]:
    pairs = []
    for task in tasks:
        answer_len = len(tokenizer.encode(task.answer, add_special_tokens=False))
        pairs.append(
            (chat_prompt_ids(tokenizer, task.prompt), min(answer_len + COPY_EDIT_OUTPUT_MARGIN, COPY_EDIT_MAX_OUTPUT))
        )
    return pairs


def make_workload(
    name: str,
    vocab_size: int,
    seed: int = 0,
    num_requests: int | None = None,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> list[BenchRequest]:
    """The requests of a standard workload; the same for the same arguments, every run.

    `num_requests` overrides the workload's count. `max_prompt_len` keeps only the last tokens of longer
    prompts (so shared-prefix prompts stay distinct and still share what is left of the prefix);
    `max_output_len` caps the output lengths. Both exist to fit a model with a short context. A text
    workload (copy-edit) needs the model's `tokenizer`."""
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
    count = num_requests or workload.num_requests
    if workload.chat is not None:
        if tokenizer is None:
            raise ValueError(
                f"the {name} workload is text: it needs the model's tokenizer, and this model has none "
                "(or the caller passed none; `tokenmill bench throughput` does)."
            )
        pairs = _chat_requests(workload.chat(rng, count), tokenizer)
    elif workload.generate is not None:
        pairs = workload.generate(rng, count, min(MAX_TOKEN_ID, vocab_size))
    return [
        BenchRequest(
            prompt_token_ids=prompt[-max_prompt_len:] if max_prompt_len else prompt,
            output_len=min(output_len, max_output_len) if max_output_len else output_len,
            temperature=workload.temperature,
            ignore_eos=workload.ignore_eos,
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
