"""Tokens and logprobs as the API writes them: a token's text, and logprobs that JSON can hold."""

from __future__ import annotations

from typing import Any

from tokenmill.engine.token_texts import token_texts
from tokenmill.outputs import TokenLogprobs


def decoded(tokenizer: Any, token_id: int, entry: TokenLogprobs | None) -> str:
    lp = (entry or {}).get(token_id)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return token_texts(tokenizer)[token_id] if tokenizer is not None else f"token_id:{token_id}"


def finite(logprob: float) -> float:
    """JSON has no -inf or NaN: a logprob that is one becomes a very unlikely finite value."""
    return max(-9999.0, logprob)  # NaN compares false, so it also becomes -9999
