"""The OpenAI API's request and response bodies as pydantic models (the /openapi.json schema comes from here).

Requests are validated strictly (a string is not an integer) and the schema states every bound the
server checks on its own, so a body the schema allows is one the server can run. Unknown fields are
ignored with one warning in the log per name (strict.py). OpenAI fields this server cannot honour
(audio, predictions, web search, image parts) are declared, so that the handler refuses them by name.
Extensions beyond OpenAI's fields follow vLLM: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`, `priority`, `stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`,
`cache_salt`, `chat_template_kwargs`, `structured_outputs` and its older names `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`.

Sampling fields a request leaves out (None here) take the model's defaults from its
generation_config.json (see `--generation-config`), then OpenAI's."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from tokenmill.sampling_params import MAX_N
from tokenmill.server.protocol_tools import (
    MAX_TOOLS,
    MessageToolCall,
    ResponseFormat,
    StructuredOutputsRequest,
    Tool,
    ToolChoice,
)
from tokenmill.server.strict import RequestBody, StrictModel

MAX_LOGPROBS = 20


def _integral(value: object) -> object:
    """JSON Schema counts 1.0 as an integer (and JavaScript clients send it): take it as 1."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_I32 = 2**31 - 1
_integral_v = BeforeValidator(_integral)
# Strict integers (no strings, no booleans) that also accept integral floats. The bounds come before
# the validator so that the schema states them as minimum / maximum.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1), _integral_v]  # OpenAI's seeds are 64-bit
TokenId = Annotated[int, Field(ge=0, le=_I32), _integral_v]
PositiveInt = Annotated[int, Field(ge=1, le=_I32), _integral_v]
NonNegativeInt = Annotated[int, Field(ge=0, le=_I32), _integral_v]
NumSamples = Annotated[int, Field(ge=1, le=MAX_N), _integral_v]
TopK = Annotated[int, Field(ge=-1, le=_I32), _integral_v]
Priority = Annotated[int, Field(ge=-_I32 - 1, le=_I32), _integral_v]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _integral_v]
StopString = Annotated[str, Field(min_length=1, max_length=1024)]
MAX_STOP_STRINGS = 16


TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[float, Field(ge=-100, le=100)]
Seconds = Annotated[float, Field(gt=0, le=1e7)]


class StreamOptions(StrictModel):
    include_usage: bool = False


class _SamplingFields(RequestBody):
    """Fields the completions and chat endpoints share."""

    model: str | None = Field(default=None, description="The served model's id (see /v1/models).")
    n: NumSamples = Field(default=1, description="Completions per prompt.")
    temperature: float | None = Field(
        default=None, ge=0.0, le=100.0, description="Default: the model's generation_config.json, else 1."
    )
    top_p: float | None = Field(
        default=None, gt=0.0, le=1.0, description="Default: the model's generation_config.json, else 1."
    )
    top_k: TopK | None = Field(default=None, description="0 or -1: no top-k.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: Int64 | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    logit_bias: dict[TokenIdKey, Bias] | None = Field(
        default=None, description="Token id (as a string) to a bias in [-100, 100]."
    )
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    priority: Priority = Field(default=0, description="Lower runs first (with --scheduling-policy priority).")
    # tokenmill extensions: deadlines, in seconds from arrival; above the server's limits they are clamped to them
    request_timeout: Seconds | None = Field(
        default=None, description="Seconds the whole request may take; past it, it ends with a 504 (type timeout)."
    )
    max_queue_time: Seconds | None = Field(
        default=None, description="Seconds it may wait for its first output; past it, it ends with a 504."
    )
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="Prefix-cache namespace: only requests with the same salt share cached prompt blocks.",
    )
    # vLLM's output constraints; at most one per request (response_format and tool_choice count too)
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = Field(default=None, description="structured_outputs.json (old name).")
    guided_regex: str | None = Field(default=None, description="structured_outputs.regex (old name).")
    guided_choice: list[str] | None = Field(default=None, description="structured_outputs.choice (old name).")
    guided_grammar: str | None = Field(default=None, description="structured_outputs.grammar (old name).")


class CompletionRequest(_SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(description="Text, token ids, or a batch of either.")
    max_tokens: PositiveInt | None = Field(default=None, description="Default: the model's max_new_tokens, else 16.")
    echo: bool = False
    logprobs: NumLogprobs | None = None
    suffix: str | None = Field(default=None, description="Not supported: must be absent or empty.")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class MediaPart(StrictModel):
    """An image, audio or file part: OpenAI's, refused here (400), since the models read text only."""

    type: Literal["image_url", "input_audio", "file"]
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(default=None, description="Text, or parts whose text is joined.")
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, description="An assistant message's tool calls.")
    tool_call_id: str | None = Field(default=None, description="A tool message's answer to this call.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
]
_REFUSED = "Not supported: 400 unless absent or null."


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = Field(default=None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description='Extra variables for the chat template, e.g. {"enable_thinking": false} (over the server\'s '
        "--chat-template-kwargs); the template's own (messages, tools, add_generation_prompt...) are refused.",
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="text (no constraint), json_object, or json_schema."
    )
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(
        default=None,
        description='Default: "auto" with tools (needs --tool-call-parser), else "none". "required" and a named '
        "function constrain the output to calls whose arguments follow the function's parameters schema.",
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one tool call per choice.")
    # OpenAI fields accepted and ignored: nothing is stored, and there is one service tier
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # OpenAI fields refused by name (chat.py)
    audio: Any = Field(default=None, description=_REFUSED + " The models write text only.")
    modalities: Any = Field(default=None, description='Only ["text"]; any other value is refused (400).')
    prediction: Any = Field(default=None, description=_REFUSED)
    web_search_options: Any = Field(default=None, description=_REFUSED)
    functions: Any = Field(default=None, description="Deprecated by OpenAI and refused (400): use tools.")
    function_call: Any = Field(default=None, description="Deprecated by OpenAI and refused (400): use tool_choice.")


# ---------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class SpeculativeDecodingUsage(_Out):
    """Draft tokens the target model verified for the request, and how many it accepted."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class PromptTokensDetails(_Out):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (the KV cache or its second tier)


class UsageInfo(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    # Only from a server that speculates (--speculative-config); left out of the JSON otherwise.
    speculative_decoding: SpeculativeDecodingUsage | None = None

    # No return annotation on purpose: with one, pydantic takes it as the serialized schema, and
    # /openapi.json would lose UsageInfo's fields.
    @model_serializer(mode="wrap")
    def _leave_out_no_speculation(self, handler: SerializerFunctionWrapHandler):
        data = handler(self)
        if data.get("speculative_decoding") is None:
            data.pop("speculative_decoding", None)
        return data


class CompletionLogprobs(_Out):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Out):
    content: list[TokenLogprobEntry] | None = None


class FunctionCall(_Out):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    # With --reasoning-parser: the reply's reasoning; left out of the JSON otherwise, as in OpenAI's replies.
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")  # no return annotation: see UsageInfo
    def _leave_out_no_reasoning(self, handler: SerializerFunctionWrapHandler):
        data = handler(self)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorInfo


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=False)
