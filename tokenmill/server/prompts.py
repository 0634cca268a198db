"""Prompts to token ids without stalling the event loop: bounds that cost a length check come first, so
a prompt that could never fit is refused before any work; tokenization and chat templating then run on
the server's prompt thread (`ServerState.prompt_pool`), while other requests' tokens keep streaming."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from tokenmill.engine.chat_template import nested_strings
from tokenmill.server.config import ServerState
from tokenmill.server.errors import APIError

T = TypeVar("T")

# The most characters one token stands for, for the length bounds: a prompt longer than this times the
# server's prompt-token cap cannot fit, whatever the tokenizer. Real text averages 3-5 characters a token
# and the longest tokens of common vocabularies (runs of spaces, dashes, "=" or digits) are a few dozen,
# so only a prompt made almost wholly of such tokens could be refused wrongly.
MAX_CHARS_PER_TOKEN = 64


def check_prompt_size(state: ServerState, prompt: str | list[int]) -> None:
    """Refuse (400) a completion prompt too long to fit in the server's prompt-token cap, by its
    length alone: characters for text, ids for token ids."""
    cap = state.max_prompt_tokens
    if isinstance(prompt, str) and len(prompt) > cap * MAX_CHARS_PER_TOKEN:
        raise _too_long(f"the prompt has {len(prompt)} characters", cap, "prompt")
    if isinstance(prompt, list) and len(prompt) > cap:
        raise _too_long(f"the prompt has {len(prompt)} tokens", cap, "prompt")


def check_messages_size(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> None:
    """Refuse (400) a conversation too long to fit, before templating it: every message takes at least
    one token in any template, and its text (content, tool calls, the tools' and the template
    variables' strings) at least one per MAX_CHARS_PER_TOKEN characters."""
    cap = state.max_prompt_tokens
    if len(messages) > cap:
        raise _too_long(f"the conversation has {len(messages)} messages", cap, "messages")
    chars = sum(len(m["content"]) for m in messages)
    chars += sum(len(s) for s in nested_strings([tools, [m.get("tool_calls") for m in messages], template_kwargs]))
    if chars > cap * MAX_CHARS_PER_TOKEN:
        raise _too_long(f"the messages hold {chars} characters", cap, "messages")


def _too_long(what: str, cap: int, param: str) -> APIError:
    return APIError(
        400,
        f"{what}, more than a prompt of at most {cap} tokens (this server's limit) can hold.",
        "prompt_too_long",
        param,
    )


async def tokenize(state: ServerState, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """A completion prompt's (text, token ids); a prompt the engine refuses is a 400."""
    try:
        if isinstance(prompt, list):  # ids are only checked: no tokenizer, no thread
            return state.engine.inputs.tokenize(prompt)
        return await _off_loop(state, state.engine.inputs.tokenize, prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_prompt", "prompt") from exc


async def chat_token_ids(
    state: ServerState,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A conversation's prompt token ids through the model's chat template (with `template_kwargs`, its
    extra variables); one it rejects is a 400."""
    try:
        return await _off_loop(
            state, state.engine.inputs.chat_token_ids, messages, add_generation_prompt, tools, template_kwargs
        )
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_messages", "messages") from exc


async def _off_loop(state: ServerState, fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(state.prompt_pool, fn, *args)
