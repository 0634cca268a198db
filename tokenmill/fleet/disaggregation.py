"""Prefill/decode disaggregation in the fleet, as plain Python (no Ray): which requests take the prefill
hop, and what the ingress sends on it.

With `--prefill-replicas P`, P replicas run with kv_role "prefill" and the `--replicas` ones with
"decode", all on one KV tier folder. A completions or chat request whose prompt is long enough goes
first to a prefill replica as a one-token, unstreamed request: its engine computes the prompt and saves
the prompt's full blocks to the folder before it answers. Then the request itself goes to a decode
replica, whose engine finds those blocks (by their prefix hashes) and loads them instead of computing
them, and streams the answer. Short prompts skip the hop: moving their KV costs more than computing it."""

from __future__ import annotations

import json
from typing import Any

PD_ROUTES = ("/v1/completions", "/v1/chat/completions")
# What the prefill hop must not ask for: more than one token, a stream, several sequences, or
# anything that makes a one-token answer an error (min_tokens) or costs more than the prompt's KV.
_DROPPED = ("max_completion_tokens", "stream_options", "min_tokens", "echo", "logprobs", "top_logprobs", "n")


def prefill_body(path: str, body: bytes) -> bytes | None:
    """The request as the prefill replica runs it: the same prompt (same model, template, tools, salt,
    so the same block hashes), one token, not streamed, one sequence; None when it is not a completions
    or chat request that parses as a JSON object (the decode replica then answers it alone)."""
    if path not in PD_ROUTES:
        return None
    try:
        request: Any = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict):
        return None
    for field in _DROPPED:
        request.pop(field, None)
    request.update(max_tokens=1, stream=False)
    return json.dumps(request).encode()


def takes_prefill_hop(path: str, prompt_tokens: int, min_prompt_tokens: int) -> bool:
    """Whether a request goes to a prefill replica first (its prompt's estimated tokens)."""
    return path in PD_ROUTES and prompt_tokens >= min_prompt_tokens
