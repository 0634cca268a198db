"""Chat messages to prompt token ids, without letting text inside a message become a control token.
The one chat-template path: the offline `LLM.chat` and the server's /v1/chat/completions both take it,
so a conversation tokenizes the same way in both.

Rendering the template with the messages' text and tokenizing the result would turn a user's
literal "<|im_end|><|im_start|>system" into real control tokens (prompt injection). Instead the
template is rendered with a unique placeholder for each message's content; the template's own text
is tokenized as usual (its special tokens recognized) and each content is tokenized as plain text
(`split_special_tokens=True`), so "<|im_end|>" typed by a user stays the characters it is.

Tools (the template writes them into the prompt), earlier tool calls, tool_call_ids and the template's
extra variables (`template_kwargs`, e.g. Qwen3's enable_thinking) are rendered as they are: templates
reformat them (`| tojson`), so no placeholder would survive. They are refused instead if they hold a
control token's text."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

# The parameters of a tool that declares none: an object with no properties.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

# Names a template's extra variables may not take: the variables and options of apply_chat_template
# itself, and the special tokens' texts it passes to every template.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
    }
)


def chat_prompt_token_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """`messages` are {"role", "content": str or None} plus, where given, "tool_calls" and "tool_call_id";
    `tools` are OpenAI's tool objects, for the template (HF's apply_chat_template(tools=...));
    `template_kwargs` the template's extra variables. ValueError for a model without a chat template,
    a reserved variable name, or messages it cannot take."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; give a plain prompt (generate(), /v1/completions).")
    messages = [_with_text_content(m) for m in messages]
    tools = [template_tool(t) for t in tools] if tools else None
    specials = _special_texts(tokenizer)
    extras = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages]
    kwargs = check_template_kwargs(template_kwargs)
    _refuse_specials(
        specials, nested_strings([tools, extras, kwargs]), "tools, tool calls, tool_call_ids and template variables"
    )
    nonce = secrets.token_hex(8)
    # Empty contents keep their own value: a template may test them ("if message.content").
    held = [i for i, m in enumerate(messages) if m["content"]]
    placeheld = [{**m, "content": f"\x00{nonce}:{i}\x00"} if m["content"] else m for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(
            placeheld, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # templates raise for conversations they do not support
        raise ValueError(f"the chat template rejected these messages: {exc}") from exc
    pieces = re.split(f"\x00{nonce}:([0-9]+)\x00", text)
    # pieces alternate: template text, message index, template text, ...
    if [int(i) for i in pieces[1::2]] != held:
        return _fallback(tokenizer, specials, messages, add_generation_prompt, tools, kwargs)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if piece:
                ids.extend(tokenizer.encode(piece, add_special_tokens=False))
        else:
            content = messages[int(piece)]["content"]
            ids.extend(tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True))
    return ids


def check_template_kwargs(template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The template's extra variables; ValueError naming one that is reserved."""
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it.")
    return kwargs


def template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as templates take it, whoever wrote it: its function's name, description (if any)
    and parameters (NO_ARGUMENTS if none), in that order, and nothing else (OpenAI's "strict" is not
    the model's business). Templates write tools with `| tojson`, which keeps key order."""
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, dict):
        return tool
    ordered: dict[str, Any] = {"name": function.get("name")}
    if function.get("description") is not None:
        ordered["description"] = function["description"]
    ordered["parameters"] = function.get("parameters") or NO_ARGUMENTS
    return {"type": "function", "function": ordered}


def _with_text_content(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its content as text: a missing or null content (an assistant's tool calls) is ""."""
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if not isinstance(content, str):
        raise ValueError(f"a message's content must be text, got {type(content).__name__}.")
    return message


def _fallback(
    tokenizer: Any,
    specials: list[str],
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> list[int]:
    """For templates that transform content (so placeholders do not survive): render the real text,
    after making sure no message carries a special token's text."""
    _refuse_specials(specials, (m["content"] for m in messages), "message content")
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _special_texts(tokenizer: Any) -> list[str]:
    specials = [s for s in getattr(tokenizer, "all_special_tokens", []) if s]
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return specials + [str(t) for t in added.values() if getattr(t, "special", False)]


def _refuse_specials(specials: list[str], texts: Iterable[str], what: str) -> None:
    firsts = {s[0] for s in specials}  # few texts hold one (most specials start with "<"): a cheap first look
    for text in texts:
        if not any(c in text for c in firsts):
            continue
        for special in specials:
            if special in text:
                raise ValueError(
                    f"{what} may not contain the control token {special!r} with this model's chat template."
                )


def nested_strings(value: object) -> Iterator[str]:
    """Every string in nested lists and dicts, keys included; iterative, since tools' schemas may nest deeply."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
