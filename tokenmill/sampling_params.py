"""Per-request sampling settings, validated once when the request is made."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# n is a fan-out of whole sequences; more than this is a mistake, not a workload.
MAX_N = 128
# 0 or less for top_k means "no top-k", as in vLLM.
_NO_TOP_K = 0
# What the OpenAI API (and vLLM) use for a sampling field that neither the request nor the model sets.
OPENAI_SAMPLING_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": _NO_TOP_K,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def with_defaults(
    explicit: Mapping[str, Any], model_defaults: Mapping[str, Any], fallback: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The fields named in `explicit`, each from the first that sets it: `explicit` (None: left out by
    the caller), the model's defaults (its generation_config.json), then `fallback`. A field none of
    them sets is left out, so SamplingParams' own default applies."""
    fallback = fallback or {}
    resolved: dict[str, Any] = {}
    for name, value in explicit.items():
        if value is None:
            value = model_defaults.get(name, fallback.get(name))
        if value is not None:
            resolved[name] = value
    return resolved


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Output constrained to a language, as vLLM names it: exactly one of a JSON schema (`json`, a dict
    or its JSON text), any JSON object (`json_object`), a regular expression, a list of `choice`s, or a
    grammar (Lark syntax, as llguidance reads it). Checked here for shape; whether the schema, regex or
    grammar compiles is checked when the request is prepared (tokenmill.structured)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice or grammar; "
                f"got {', '.join(given) or 'none'}."
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return (
            "json_object"
            if self.json_object
            else next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)
        )


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_p, top_k and min_p filter before sampling. `seed` makes a
    request's samples reproducible whatever else is in the batch. `logprobs=k` returns the top-k
    logprobs (plus the sampled token's) for each generated token; `prompt_logprobs=k` the same for
    prompt tokens. Stop strings are excluded from the returned text.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = _NO_TOP_K
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}.")
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0 or value > 20):
                raise ValueError(f"{name} must be an integer in [0, 20], got {value!r}.")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if tok < 0:
                    raise ValueError(f"logit_bias has a negative token id {tok}.")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for {tok}.")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reads_sampled_tokens(self) -> bool:
        """Whether sampling the next token reads the tokens sampled so far on the host (a grammar's state,
        the penalties' counts): async scheduling then waits for a step's tokens before the next step."""
        return self.structured_outputs is not None or self.uses_penalties

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for tok in list(self.logit_bias or {}) + self.stop_token_ids:
            if tok >= vocab_size:
                raise ValueError(f"token id {tok} is outside the vocabulary (size {vocab_size}).")


def params_for_wire(params: SamplingParams) -> SamplingParams:
    """`params` fit for msgpack (tokenmill.wire): a dict JSON schema as its JSON text, the same grammar
    under the same compile-cache key, since msgpack cannot carry the integers past 64 bits that a
    schema may hold. Returns `params` itself when there is nothing to change."""
    spec = params.structured_outputs
    if spec is None or not isinstance(spec.json, dict):
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(spec, json=json.dumps(spec.json)))
