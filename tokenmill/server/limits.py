"""This server's per-request caps that are not lengths (those are the engine's, request_limits.py):
n, prompts per request, logit_bias entries, and echo's prompt logprobs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.engine.input_processor import PreparedRequest
from tokenmill.server.config import ServerState
from tokenmill.server.errors import APIError


def check_n(state: ServerState, n: int, num_prompts: int = 1) -> None:
    if n > state.config.max_n:
        raise APIError(400, f"n is {n}; this server allows at most {state.config.max_n}.", "n_too_large", "n")
    if num_prompts > state.config.max_prompts_per_request:
        raise APIError(
            400,
            f"{num_prompts} prompts in one request; this server allows at most {state.config.max_prompts_per_request}.",
            "too_many_prompts",
            "prompt",
        )


def check_logit_bias(state: ServerState, logit_bias: Mapping[Any, float] | None) -> None:
    cap = state.config.max_logit_bias
    if logit_bias and len(logit_bias) > cap:
        raise APIError(
            400,
            f"logit_bias has {len(logit_bias)} entries; this server allows at most {cap}.",
            "logit_bias_too_large",
            "logit_bias",
        )


def check_prompt_logprobs(state: ServerState, prepared: list[PreparedRequest]) -> None:
    """Echo with logprobs returns up to k + 1 entries per prompt token (the top k and the prompt's own);
    cap their total over the request's prompts. The n samples of a prompt share one computation of its
    prompt logprobs, so n does not multiply it."""
    entries = sum(
        (p.params.prompt_logprobs + 1) * len(p.prompt_token_ids)
        for p in prepared
        if p.params.prompt_logprobs is not None
    )
    cap = state.config.max_prompt_logprobs_entries
    if entries > cap:
        raise APIError(
            400,
            f"echo with logprobs asks for {entries} prompt logprob entries ((logprobs + 1) x prompt tokens, "
            f"summed over the prompts); this server allows at most {cap}. Ask for fewer logprobs, send shorter "
            "or fewer prompts, or leave out echo.",
            "prompt_logprobs_too_large",
            "logprobs",
        )
