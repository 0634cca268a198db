"""An Anthropic Messages request as the chat request the OpenAI route runs, so that both APIs share one
pipeline (prepare_chat, tool plans, replies). The system prompt becomes a system message; an assistant
turn's tool_use blocks become its tool_calls; a user turn's tool_result blocks become "tool" messages,
as chat templates take tool results; tool_choice any / tool / none become "required" / a named function /
"none"; output_config.format is chat's json_schema response_format; earlier turns' thinking blocks are
left out. What this server cannot do is refused by name (400): image and document blocks, extended
thinking without --reasoning-parser, server tools, and a conversation ending with an assistant turn
(Anthropic's prefill)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from tokenmill.server.anthropic_protocol import (
    AnthropicToolChoice,
    CountTokensRequest,
    InputMessage,
    MediaBlock,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.server.protocol_tools import (
    FunctionDefinition,
    MessageFunctionCall,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolChoice,
)

# Tool templates have no flag for a failed call: the model reads that it failed in the result's text.
ERROR_RESULT_PREFIX = "Error: "


def chat_request(body: CountTokensRequest, reasoning: bool) -> ChatCompletionRequest:
    """The chat request for `body` (a MessagesRequest: with its sampling fields); APIError 400 for what
    cannot be translated. `reasoning`: the server parses the replies' reasoning (--reasoning-parser)."""
    _refuse_unsupported(body, reasoning)
    messages = _system(body.system)
    for i, message in enumerate(body.messages):
        messages += _turn(i, message)
    choice, parallel = _tool_choice(body.tool_choice)
    tools = [
        Tool(
            type="function",
            function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema),
        )
        for t in body.tools or []
    ]
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": body.stream,
        }
        if body.output_config is not None and body.output_config.format is not None:
            schema = body.output_config.format.schema_
            fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # checked above, so not expected: a 400 all the same, never a 500
        raise APIError(400, f"the request cannot be run: {exc.errors()[0].get('msg', 'invalid value')}.") from exc


def _refuse_unsupported(body: CountTokensRequest, reasoning: bool) -> None:
    if body.thinking is not None and body.thinking.get("type") != "disabled" and not reasoning:
        raise APIError(
            400,
            "extended thinking needs a server started with --reasoning-parser (and a reasoning model): "
            "leave thinking out.",
            "unsupported",
            "thinking",
        )
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise APIError(
                400,
                f"server tools ({tool.type}) are not supported: give client tools with an input_schema.",
                "unsupported",
                f"tools.{i}.type",
            )
        if tool.input_schema is None:
            raise APIError(400, "a tool needs an input_schema.", "invalid_request", f"tools.{i}.input_schema")
    last = body.messages[-1]
    if last.role == "assistant":
        raise APIError(
            400,
            "a conversation that ends with an assistant turn (prefill) is not supported: end it with a user turn.",
            "unsupported",
            f"messages.{len(body.messages) - 1}",
        )


def _system(system: str | list[TextBlock] | None) -> list[ChatMessage]:
    text = system if isinstance(system, str) or system is None else "".join(block.text for block in system)
    return [ChatMessage(role="system", content=text)] if text else []


def _turn(i: int, message: InputMessage) -> list[ChatMessage]:
    """One turn as chat messages: an assistant turn is one message (text and tool calls); a user turn's
    tool results are "tool" messages, its text a user message, in their order."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    out: list[ChatMessage] = []
    text: list[str] = []
    calls: list[MessageToolCall] = []
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, MediaBlock):
            raise _unsupported_media(block, where)
        if isinstance(block, ThinkingBlock):
            continue
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise APIError(400, "tool_use blocks belong in assistant turns.", "invalid_request", where)
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                MessageToolCall(id=block.id, function=MessageFunctionCall(name=block.name, arguments=arguments))
            )
        else:
            if message.role != "user":
                raise APIError(400, "tool_result blocks belong in user turns.", "invalid_request", where)
            if text:  # text before a result (Anthropic puts results first): keep the order
                out.append(ChatMessage(role="user", content="".join(text)))
                text = []
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=_result_text(block, where)))
    if text or calls or not out:
        out.append(ChatMessage(role=message.role, content="".join(text), tool_calls=calls or None))
    return out


def _result_text(block: ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        for k, part in enumerate(block.content):
            if isinstance(part, MediaBlock):
                raise _unsupported_media(part, f"{where}.content.{k}")
        text = "".join(part.text for part in block.content if isinstance(part, TextBlock))
    return ERROR_RESULT_PREFIX + text if block.is_error else text


def _unsupported_media(block: MediaBlock, where: str) -> APIError:
    return APIError(
        400,
        f"{block.type} content blocks are not supported: this server's models read text only.",
        "unsupported_content",
        where,
    )


def _tool_choice(choice: AnthropicToolChoice | None) -> tuple[ToolChoice | None, bool | None]:
    """Anthropic's tool_choice as chat's, and parallel_tool_calls (None: the default, parallel)."""
    if choice is None:
        return None, None
    if isinstance(choice, ToolChoiceNone):
        return "none", None
    parallel = False if choice.disable_parallel_tool_use else None
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    if isinstance(choice, ToolChoiceTool):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name)), parallel
    return "auto", parallel
