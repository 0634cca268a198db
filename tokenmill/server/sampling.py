"""OpenAI's sampling fields to the engine's SamplingParams: the HTTP translation, nothing more (the
limits are the engine's, request_limits.py)."""

from __future__ import annotations

from collections.abc import Mapping

from tokenmill.sampling_params import (
    OPENAI_SAMPLING_DEFAULTS,
    SamplingParams,
    StructuredOutputsParams,
    with_defaults,
)
from tokenmill.server.protocol import _SamplingFields


def sampling_params(
    body: _SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    model_defaults: Mapping[str, float | int],
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for one prompt of the request (ValueError -> 400). A sampling field
    the request leaves out comes from the model's defaults (its generation_config.json), else OpenAI's.
    `max_tokens` is what the request asked for (None: the engine resolves the default); min_tokens
    never exceeds it. `structured_outputs` is the request's output constraint (constraints.py)."""
    explicit = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
    }
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens if max_tokens is None else min(body.min_tokens, max_tokens),
        **with_defaults(explicit, model_defaults, OPENAI_SAMPLING_DEFAULTS),
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured_outputs=structured_outputs,
    )
