"""Chat messages to prompt token ids, without letting text inside a message become a control token.

Rendering the template with the messages' text and tokenizing the result would turn a user's
literal "<|im_end|><|im_start|>system" into real control tokens (prompt injection). Instead the
template is rendered with a unique placeholder for each message's content; the template's own text
is tokenized as usual (its special tokens recognized) and each content is tokenized as plain text
(`split_special_tokens=True`), so "<|im_end|>" typed by a user stays the characters it is."""

from __future__ import annotations

import re
import secrets
from typing import Any


def chat_prompt_token_ids(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True
) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions with a plain prompt.")
    nonce = secrets.token_hex(8)
    marks = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
    placeheld = [{**m, "content": mark} for m, mark in zip(messages, marks)]
    try:
        text = tokenizer.apply_chat_template(placeheld, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # templates raise for conversations they do not support
        raise ValueError(f"the chat template rejected these messages: {exc}") from exc
    pieces = re.split(f"\x00{nonce}:([0-9]+)\x00", text)
    # pieces alternate: template text, message index, template text, ...
    found = [int(i) for i in pieces[1::2]]
    if found != list(range(len(messages))):
        return _fallback(tokenizer, messages, add_generation_prompt)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if piece:
                ids.extend(tokenizer.encode(piece, add_special_tokens=False))
        else:
            content = messages[int(piece)]["content"]
            if content:
                ids.extend(tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True))
    return ids


def _fallback(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """For templates that transform content (so placeholders do not survive): render the real text,
    after making sure no message carries a special token's text."""
    specials = [s for s in getattr(tokenizer, "all_special_tokens", []) if s]
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials += [str(t) for t in added.values() if getattr(t, "special", False)]
    for message in messages:
        for special in specials:
            if special in message["content"]:
                raise ValueError(
                    f"message content may not contain the control token {special!r} with this model's chat template."
                )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))
