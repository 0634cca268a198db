"""The Responses API onto the chat pipeline, both ways: a request's items (after the previous responses'
ones) become a ChatCompletionRequest's messages, its tools, tool_choice and text.format the chat fields
that mean the same; the chat route's reply becomes the response's output items, status and usage."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError

from tokenmill.server.errors import APIError
from tokenmill.server.job import Job
from tokenmill.server.protocol import AssistantMessage, ChatCompletionRequest
from tokenmill.server.responses_protocol import (
    PASSED_TO_CHAT,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputTokensDetails,
    Item,
    ItemStatus,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    Status,
    TextContent,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    UnsupportedContent,
    UnsupportedItem,
    UnsupportedTool,
)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponsesRequest) -> list[Item]:
    """The request's input as items, each with an id (the input_items listing shows them); 400 for an
    item or content part this server cannot read."""
    items: list[Item] = []
    for i, item in enumerate(body.input):
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, UnsupportedItem):
            raise APIError(
                400, f"input items of type {item.type!r} are not supported.", "unsupported_item", f"input.{i}"
            )
        field, parts = (
            ("content", item.content) if isinstance(item, MessageItem) else ("output", getattr(item, "output", ""))
        )
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, UnsupportedContent):
                raise APIError(
                    400,
                    f"{part.type} content is not supported: this server's models read text only.",
                    "unsupported_content",
                    f"input.{i}.{field}.{j}",
                )
        prefix = "fc" if isinstance(item, FunctionCallItem) else "msg" if isinstance(item, MessageItem) else "fco"
        items.append(item if item.id is not None else item.model_copy(update={"id": new_item_id(prefix)}))
    return items


def output_as_items(output: list[OutputItem]) -> list[Item]:
    """A stored response's output as the next turn's input items (its reasoning left out, as templates drop it)."""
    items: list[Item] = []
    for out in output:
        if isinstance(out, OutputMessage):
            parts = [TextContent(type="output_text", text=part.text) for part in out.content]
            items.append(MessageItem(role="assistant", content=list(parts), id=out.id, status=out.status))
        elif isinstance(out, OutputFunctionCall):
            call = FunctionCallItem(
                type="function_call", call_id=out.call_id, name=out.name, arguments=out.arguments, id=out.id
            )
            items.append(call)
    return items


def chat_request(body: ResponsesRequest, items: list[Item]) -> ChatCompletionRequest:
    """The chat request that means the same (400 for what has no chat meaning)."""
    _refuse_unsupported(body)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += _messages(items)
    data: dict[str, Any] = {"model": body.model, "messages": messages, "stream": False}
    for field in ("temperature", "top_p", "user", "parallel_tool_calls", *PASSED_TO_CHAT):
        if (value := getattr(body, field)) is not None:
            data[field] = value
    if body.max_output_tokens is not None:
        data["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        data["tools"] = [{"type": "function", "function": _function(t)} for t in _functions(body)]
    if body.tool_choice is not None:
        choice = body.tool_choice
        data["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJsonObject):
        data["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, TextFormatJsonSchema):
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        data["response_format"] = {"type": "json_schema", "json_schema": spec}
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:  # what the Responses model let through and chat does not take
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{first.get('msg', 'invalid value')} at {where}.", "invalid_request") from exc


def _refuse_unsupported(body: ResponsesRequest) -> None:
    for i, tool in enumerate(body.tools or []):
        if isinstance(tool, UnsupportedTool):
            raise APIError(
                400,
                f"tools of type {tool.type!r} are not supported: this server runs function tools only.",
                "unsupported_tool",
                f"tools.{i}",
            )
    for field, why in (
        ("conversation", "conversations are not supported: give previous_response_id, or the whole input."),
        ("prompt", "reusable prompts are not supported: give instructions and input."),
    ):
        if getattr(body, field) is not None:
            raise APIError(400, why, "unsupported_parameter", field)
    if body.background and not body.store:
        raise APIError(400, "background responses must be stored: give store: true.", "invalid_request", "store")
    if body.background and body.stream:
        raise APIError(
            400, "background responses are not streamed here: poll GET /v1/responses/{id}.", "unsupported_parameter"
        )


def _functions(body: ResponsesRequest) -> list[FunctionTool]:
    """The function tools (other types are refused before this)."""
    return [tool for tool in body.tools or [] if isinstance(tool, FunctionTool)]


def _function(tool: FunctionTool) -> dict[str, Any]:
    return tool.model_dump(exclude={"type"}, exclude_none=True)


def _messages(items: list[Item]) -> list[dict[str, Any]]:
    """Items as chat messages: a function call joins the assistant message just before it (or starts
    one); its output is a tool message. 400 for an output whose call_id no earlier call has."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise APIError(
                    400,
                    f"no function_call with call_id {item.call_id!r} comes before this function_call_output.",
                    "invalid_request",
                    "input",
                )
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
    if not messages:
        raise APIError(400, "the input holds no message.", "invalid_request", "input")
    return messages


def echoed_settings(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as a response repeats them."""
    tools = [{"type": "function", **_function(t)} for t in _functions(body)]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else {}
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools,
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "text": {"format": {"type": "text"}, **text},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "metadata": dict(body.metadata or {}),
        "user": body.user,
        "store": body.store,
        "background": body.background,
    }


def output_items(message: AssistantMessage, status: Status) -> list[OutputItem]:
    """The chat reply's reasoning, text (a message) and tool calls (function_call items)."""
    item_status = item_status_of(status)
    output: list[OutputItem] = []
    if message.reasoning_content:
        reasoning = [ReasoningText(text=message.reasoning_content)]
        # As streamed: the reasoning is complete once the answer has begun.
        done = "completed" if message.content or message.tool_calls else item_status
        output.append(OutputReasoning(id=new_item_id("rs"), status=done, content=reasoning))
    if message.content is not None and (message.content or not message.tool_calls):
        text = OutputText(text=message.content)
        output.append(OutputMessage(id=new_item_id("msg"), status=item_status, content=[text]))
    for call in message.tool_calls or []:
        name, arguments = call.function.name, call.function.arguments
        fc = OutputFunctionCall(
            id=new_item_id("fc"), call_id=call.id, name=name, arguments=arguments, status=item_status
        )
        output.append(fc)
    return output


def item_status_of(status: Status) -> ItemStatus:
    """An output item's status at the response's end."""
    return "completed" if status == "completed" else "incomplete"


def final_status(finish_reason: str | None, cancelled: bool) -> Status:
    if cancelled or finish_reason == "abort":
        return "cancelled"
    return "incomplete" if finish_reason == "length" else "completed"


def finished(base: ResponseObject, status: Status, output: list[OutputItem], job: Job) -> ResponseObject:
    """The response once its job has ended: status, output, usage."""
    usage = job.usage()
    return base.model_copy(
        update={
            "status": status,
            "output": output,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            "usage": ResponseUsage(
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            ),
        }
    )
