"""Tool calling, the request side: what tool_choice asks for, the tools and the conversation as the chat
template takes them, and for "required" or a named function the JSON schema that constrains the output,
so that its calls always parse and their arguments follow the function's parameters schema.

- "none" (the default without tools): the tools are left out of the prompt; the output is content.
- "auto" (the default with tools): the model writes freely, with the tools in its prompt; the server's
  `--tool-call-parser` finds the calls in its text (tool_parsers.py). Without one: 400, as in vLLM.
- "required": the output is a JSON array of {"name": <a tool's name>, "arguments": <its parameters>}
  (one item unless parallel_tool_calls), then turned into tool calls.
- {"type": "function", "function": {"name": N}}: the output is N's arguments object."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.engine.chat_template import NO_ARGUMENTS
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.server.protocol_tools import Tool
from tokenmill.server.reasoning import Reasoning
from tokenmill.server.tool_json import ParsedCall, arguments_text, array_items, call_from_text
from tokenmill.server.tool_parsers import ToolParser

_DEFS_KEYS = ("$defs", "definitions")


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    template_tools: list[dict[str, Any]] | None = None  # what the chat template gets
    schema: dict[str, Any] | None = None  # the output's JSON schema (required, named)
    function: str | None = None  # the named function
    parallel: bool = True
    parser: ToolParser | None = None  # auto
    # With --reasoning-parser, how the reply's reasoning is found (set once the prompt is known, chat.py)
    reasoning: Reasoning | None = None

    @property
    def constrained(self) -> bool:
        return self.schema is not None


def plan_tools(body: ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan:
    """What the request's tools and tool_choice ask for; APIError 400 for what cannot be done."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("none")
    what = f'"{choice}"' if isinstance(choice, str) else "naming a function"
    if not tools:
        raise APIError(400, f"tool_choice {what} needs tools.", "invalid_request", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise APIError(400, "two tools have the same name.", "invalid_request", "tools")
    template_tools = [_template_tool(t) for t in tools]
    parallel = body.parallel_tool_calls is not False  # OpenAI's default: true
    if choice == "auto":
        if parser is None:
            raise APIError(
                400,
                'tool_choice "auto" (the default when tools are given) needs a tool-call parser: start the server '
                "with --tool-call-parser (hermes or llama3_json, as the model's chat template writes calls), or "
                'ask for tool_choice "required", a named function, or "none".',
                "tool_parser_not_configured",
                "tool_choice",
            )
        return ToolPlan("auto", template_tools, parallel=parallel, parser=parser)
    if isinstance(choice, str):  # "required"
        return ToolPlan("required", template_tools, required_schema(tools, parallel), parallel=parallel)
    name = choice.function.name
    if name not in names:
        raise APIError(
            400, f"tool_choice names {name!r}, which is not among the tools.", "invalid_request", "tool_choice"
        )
    parameters = tools[names.index(name)].function.parameters
    return ToolPlan("named", template_tools, parameters or NO_ARGUMENTS, function=name, parallel=parallel)


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each {"name": const, "arguments": that tool's parameters}. Each tool's
    "$defs" / "definitions" move to the root, where its "#/$defs/..." references now point."""
    calls: list[dict[str, Any]] = []
    defs: dict[str, dict[str, Any]] = {key: {} for key in _DEFS_KEYS}
    for tool in tools:
        parameters = dict(tool.function.parameters or NO_ARGUMENTS)
        for key in _DEFS_KEYS:
            if isinstance(parameters.get(key), dict):
                for name, definition in parameters.pop(key).items():
                    if defs[key].setdefault(name, definition) != definition:
                        raise APIError(400, f"two tools define {key}/{name} differently.", "invalid_request", "tools")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({key: found for key, found in defs.items() if found})
    return schema


def constrained_calls(plan: ToolPlan, text: str) -> list[ParsedCall] | None:
    """The calls in an output constrained by `plan.schema`; None when it does not parse (a reply cut
    by max_tokens: it is returned as content)."""
    if plan.mode == "named":
        found = arguments_text(text)
        return None if found is None or plan.function is None else [ParsedCall(plan.function, found)]
    items = array_items(text)
    calls = [call_from_text(item) for item in items or []]
    return None if not calls or any(c is None for c in calls) else [c for c in calls if c is not None]


def _template_tool(tool: Tool) -> dict[str, Any]:
    """The tool as OpenAI's JSON; chat_template.template_tool puts it in the templates' form."""
    return {"type": "function", "function": tool.function.model_dump()}


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it. A tool call's arguments go as an object where they parse
    to one: templates (Llama 3.1, Qwen2.5) write them with `| tojson`, which would quote a string."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(text: str) -> dict[str, Any] | str:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text
