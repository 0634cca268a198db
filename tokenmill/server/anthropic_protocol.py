"""Anthropic's Messages API request and response bodies as pydantic models (POST /v1/messages and
/v1/messages/count_tokens).

Requests are strict and ignore unknown fields with one warning per name, as the OpenAI routes do
(strict.py). Content blocks this server cannot read (images, documents) and extended thinking are
declared, so that the route refuses them by name (400) rather than answer without them. `cache_control`
is accepted everywhere Anthropic allows it and ignored: the prefix cache works without hints."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.server.protocol import (
    MAX_STOP_STRINGS,
    NonNegativeInt,
    PositiveInt,
    StopString,
)
from tokenmill.server.protocol_tools import MAX_TOOLS, FunctionName
from tokenmill.server.strict import RequestBody, StrictModel

CacheControl = dict[str, Any] | None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: Any = Field(default=None, description="Accepted and ignored.")


class MediaBlock(StrictModel):
    """An image or document block: refused (400), since the models read text only."""

    type: Literal["image", "document"]
    source: Any = None
    cache_control: CacheControl = None


class ToolUseBlock(StrictModel):
    """A tool call of an earlier assistant turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ThinkingBlock(StrictModel):
    """An earlier assistant turn's thinking, sent back: left out of the prompt (as Anthropic leaves out
    earlier turns' thinking)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ResultPart = Annotated[TextBlock | MediaBlock, Field(discriminator="type")]


class ToolResultBlock(StrictModel):
    """A user turn's answer to a tool call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] = ""
    is_error: bool = False
    cache_control: CacheControl = None


ContentBlock = Annotated[
    TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class InputMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(StrictModel):
    """A client tool. Anthropic's server tools (web search, code execution, ...) have a `type` and no
    input_schema: refused by name (messages.py)."""

    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any] | None = Field(default=None, description="A JSON schema of the tool's input object.")
    type: str | None = Field(default=None, description='"custom" or absent; server tools are not supported.')
    cache_control: CacheControl = None


class ToolChoiceAuto(StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(StrictModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(StrictModel):
    type: Literal["none"]


AnthropicToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class CountTokensRequest(RequestBody):
    """POST /v1/messages/count_tokens: the conversation, its system prompt and tools."""

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = Field(
        default=None,
        description='"enabled" or "adaptive" need --reasoning-parser (the reply\'s reasoning comes as a thinking '
        'block; budget_tokens is not used); without one, 400. "disabled" is accepted.',
    )


class Metadata(StrictModel):
    user_id: str | None = Field(default=None, max_length=256)


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    # `schema` would shadow a BaseModel attribute, hence the alias
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the reply's text follows.")


class OutputConfig(StrictModel):
    format: JsonOutputFormat | None = Field(default=None, description="Structured output, as chat's json_schema.")
    effort: str | None = Field(default=None, description="Accepted and not used.")


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. Sampling fields left out take the model's defaults (generation_config.json)."""

    max_tokens: PositiveInt = Field(description="Required, as in Anthropic's API.")
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: NonNegativeInt | None = Field(default=None, description="0: no top-k.")
    metadata: Metadata | None = Field(default=None, description="Accepted and not used.")
    stream: bool = False
    service_tier: Literal["auto", "standard_only"] | None = Field(default=None, description="Accepted; one tier.")
    output_config: OutputConfig | None = None


# ---------------------------------------------------------------------- responses


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextOut(_Out):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(_Out):
    """The reply's reasoning (with --reasoning-parser); its signature is empty: nothing checks it here."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(_Out):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(_Out):
    """Anthropic counts prompt tokens read from the cache apart: the prompt is the sum of the three."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(_Out):
    input_tokens: int


class AnthropicError(_Out):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...")
    message: str


class AnthropicErrorResponse(_Out):
    type: Literal["error"] = "error"
    error: AnthropicError
