"""The OpenAI Responses API's request and response bodies as pydantic models (POST /v1/responses).

A request is validated strictly, as the chat route's are (strict.py: unknown fields ignored with one
warning each). Item and tool types this server cannot run (images, files, built-in tools) parse into
catch-all models so that the route refuses them by name (400) rather than with a validation puzzle."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from tokenmill.server.protocol import Int64, Metadata, PositiveInt, Priority, Seconds, TopK
from tokenmill.server.protocol_tools import MAX_TOOLS, FunctionName
from tokenmill.server.strict import RequestBody, StrictModel

# ---------------------------------------------------------------------- input items


class TextContent(StrictModel):
    """Text in a message: the user's (input_text) or an earlier reply's (output_text)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalContent(StrictModel):
    type: Literal["refusal"]
    refusal: str


class _Refused(BaseModel):
    """What the route refuses by its type: its other fields are not read, so not warned about."""

    model_config = ConfigDict(extra="ignore")


class UnsupportedContent(_Refused):
    """An image, file or audio part: refused (400), the models read text only."""

    type: str


def _content_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("input_text", "output_text"):
        return "text"
    return "refusal" if kind == "refusal" else "other"


ContentPart = Annotated[
    Annotated[TextContent, Tag("text")]
    | Annotated[RefusalContent, Tag("refusal")]
    | Annotated[UnsupportedContent, Tag("other")],
    Discriminator(_content_tag),
]


class MessageItem(StrictModel):
    """An easy input message (no type) or a `message` item, an earlier reply's included."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = self.content
        return "".join(p.text if isinstance(p, TextContent) else getattr(p, "refusal", "") for p in parts)


class FunctionCallItem(StrictModel):
    """A function call the model made earlier, sent back in the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    """The caller's result of a function call (matched by call_id)."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output if isinstance(p, TextContent))


class ReasoningItem(_Refused):
    """An earlier response's reasoning, sent back as clients replay output items: accepted and left out
    of the prompt (chat templates drop earlier turns' reasoning too)."""

    type: Literal["reasoning"]


class UnsupportedItem(_Refused):
    """Any other item type (reasoning, item_reference, built-in tool calls): refused by name (400)."""

    type: str


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[UnsupportedItem, Tag("other")],
    Discriminator(_item_tag),
]
Item = MessageItem | FunctionCallItem | FunctionCallOutputItem  # what a stored conversation holds

# ---------------------------------------------------------------------- tools, text format


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON schema of the arguments object; absent: no arguments."
    )
    strict: bool | None = Field(default=None, description="Accepted: constrained calls always follow the schema.")


class UnsupportedTool(_Refused):
    """A built-in tool (web_search, file_search, ...): refused by name (400)."""

    type: str


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else "other"


ResponsesTool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[UnsupportedTool, Tag("other")], Discriminator(_tool_tag)
]


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(max_length=256)
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the output follows.")
    description: str | None = None
    strict: bool | None = Field(default=None, description="Accepted: the output always follows the schema.")


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(default=None, description="Accepted and not used.")


# ---------------------------------------------------------------------- the request


def _text_as_message(value: Any) -> Any:
    """Input text is one user message (so that errors in items point at input.N, not at a union)."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class ResponsesRequest(RequestBody):
    model: str | None = Field(default=None, description="The served model's id (see /v1/models).")
    input: Annotated[list[InputItem], Field(min_length=1), BeforeValidator(_text_as_message)] = Field(
        description="Text (one user message), or items: messages, function_call, function_call_output."
    )
    instructions: str | None = Field(default=None, description="A system message first (not carried over).")
    previous_response_id: str | None = Field(
        default=None, description="A stored response: its input and output items come before this input."
    )
    max_output_tokens: PositiveInt | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Metadata | None = None
    user: str | None = None
    store: bool = Field(default=True, description="false: not kept (no GET, no previous_response_id).")
    background: bool = Field(default=False, description="true: answered at once (queued); poll with GET.")
    stream: bool = False
    # vLLM-style extensions, as on the chat route
    seed: Int64 | None = None
    top_k: TopK | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    priority: Priority = 0
    request_timeout: Seconds | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description='Extra variables for the chat template, e.g. {"enable_thinking": false}.'
    )
    # OpenAI fields refused by name (400): stored conversations and prompt templates are not kept here
    conversation: Any = Field(default=None, description="Not supported: give previous_response_id or the items.")
    prompt: Any = Field(default=None, description="Not supported: reusable prompts are not stored here.")


PASSED_TO_CHAT = (
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "priority",
    "request_timeout",
    "cache_salt",
    "chat_template_kwargs",
)

# ---------------------------------------------------------------------- the response


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(_Out):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(_Out):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(_Out):
    """The reply's reasoning (with --reasoning-parser), before its message or calls."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(_Out):
    cached_tokens: int = 0


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class ResponseUsage(_Out):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseError(_Out):
    code: str
    message: str


Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponseObject(_Out):
    """A response as openai.types.responses.Response parses it; the request's settings are echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    store: bool = True
    background: bool = False
    truncation: Literal["disabled"] = "disabled"


class DeletedResponse(_Out):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class InputItemList(_Out):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
