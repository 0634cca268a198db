"""Request fields that shape the output: OpenAI's `response_format`, `tools` and `tool_choice`, and vLLM's
`structured_outputs` (its older `guided_*` fields are plain fields of the requests, in protocol.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from tokenmill.server.strict import StrictModel

MAX_TOOLS = 128  # OpenAI's cap

# OpenAI's rule for function names; it also keeps them plain text in the prompt and in the output's JSON.
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class ResponseFormatText(StrictModel):
    type: Literal["text"]


class ResponseFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    name: str | None = Field(default=None, max_length=256, description="Accepted and not used.")
    description: str | None = Field(default=None, description="Accepted and not used.")
    # `schema` would shadow a BaseModel attribute, hence the alias
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="The JSON schema the output follows; absent: any JSON object."
    )
    strict: bool | None = Field(default=None, description="Accepted: the output always follows the schema.")


class ResponseFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="A JSON schema, or its text.")
    json_object: bool | None = Field(default=None, description="true: any JSON object.")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, description="The output is exactly one of these.")
    grammar: str | None = Field(default=None, description="A grammar in Lark syntax, as llguidance reads it.")


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON schema of the arguments object; absent: no arguments."
    )
    strict: bool | None = Field(default=None, description="Accepted: constrained calls always follow the schema.")


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class MessageFunctionCall(StrictModel):
    name: str
    arguments: str = Field(description="The arguments object as JSON text, as the model wrote it.")


class MessageToolCall(StrictModel):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall
