"""Tool calling through the official openai client, on the tiny random model with a Hermes-style template
(conftest.HERMES_TOOLS_TEMPLATE) and `--tool-call-parser hermes`: tool_choice "required" and named
functions give calls whose arguments follow the tool's schema, streamed (a call's name first, then its
arguments piece by piece, assembled as the SDK does) or not; "auto" finds <tool_call> blocks in the
text; a tool's result continues the conversation."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.conftest import MODEL_NAME, RunningServer, long_context_copy, run_server
from tokenmill.server.config import ServerConfig

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
PARAMETERS = {"get_weather": CITY, "get_time": TIME}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "description": f"{name} somewhere", "parameters": schema}}
    for name, schema in PARAMETERS.items()
]
STRICT_TOOLS: list[Any] = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tool_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # The tools' JSON takes hundreds of the tiny tokenizer's tokens: a copy with a longer context.
    model = long_context_copy(tool_chat_model, tmp_path_factory.mktemp("tools") / "model")
    config = ServerConfig(tool_call_parser="hermes")
    with run_server(model, config, max_model_len=2048, num_kv_blocks=512, max_num_batched_tokens=1024) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def assert_valid_calls(tool_calls: Any) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


# ---------------------------------------------------------------------- required and named: constrained


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_returns_calls_whose_arguments_validate(client: openai.OpenAI, seed: int) -> None:
    # Parallel calls: as many as the model likes (each "," or "]" is its choice), so room for several.
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=1000, seed=seed
    ).choices[0]
    assert out.finish_reason == "tool_calls"
    assert out.message.content is None
    assert_valid_calls(out.message.tool_calls)


def test_required_without_parallel_calls_returns_one_call(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=3,
        max_tokens=200,
        seed=4,
    )
    for choice in out.choices:
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls)


def test_a_named_function_is_called(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=WEATHER, n=2, max_tokens=200, seed=5
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        assert_valid_calls(choice.message.tool_calls)


def test_streamed_required_calls_assemble_with_the_sdks_stream_helper(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL_NAME, messages=MESSAGES, tools=STRICT_TOOLS, tool_choice="required", max_tokens=1000, seed=6
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(final.choices[0].message.tool_calls)
    for call in final.choices[0].message.tool_calls or []:
        assert call.function.parsed_arguments == json.loads(call.function.arguments)


def call_deltas(chunks: list[Any]) -> list[Any]:
    return [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]


def assert_streamed_piece_by_piece(calls: list[Any], name: str) -> str:
    """The call's first delta has its id and name, the next ones only pieces of its arguments; their text."""
    first, *rest = calls
    assert first.id.startswith("call_") and first.type == "function" and first.function.name == name
    assert len(rest) > 1 and all(c.id is None and c.function.name is None for c in rest)
    assert all(c.index == first.index for c in calls)
    return "".join(c.function.arguments or "" for c in calls)


def test_streamed_named_call_arrives_piece_by_piece(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=WEATHER, max_tokens=200, seed=7, stream=True
        )
    )
    arguments = assert_streamed_piece_by_piece(call_deltas(chunks), "get_weather")
    jsonschema.validate(json.loads(arguments), CITY)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [c.function.name for c in final.message.tool_calls or []] == ["get_weather"]
    assert_valid_calls(final.message.tool_calls)
    unstreamed = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=WEATHER, max_tokens=200, seed=7
    ).choices[0]
    assert unstreamed.message.tool_calls is not None and final.message.tool_calls is not None
    assert final.message.tool_calls[0].function.arguments == unstreamed.message.tool_calls[0].function.arguments
    assert arguments == unstreamed.message.tool_calls[0].function.arguments


# ---------------------------------------------------------------------- the conversation goes on


def test_tools_go_into_the_prompt_unless_tool_choice_is_none(client: openai.OpenAI) -> None:
    def prompt_tokens(tool_choice: Any) -> int:
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200
        )
        assert out.usage is not None
        return out.usage.prompt_tokens

    assert prompt_tokens("required") > prompt_tokens("none")


def test_a_tool_result_continues_the_conversation(client: openai.OpenAI) -> None:
    call = (
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=WEATHER, max_tokens=200, seed=8
        )
        .choices[0]
        .message
    )
    assert call.tool_calls is not None
    tool_call = call.tool_calls[0]
    history: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "Sunny, 24 C."},
    ]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert isinstance(out.choices[0].message.content, str) and out.usage is not None
    # The call and its result are in the prompt, as the template writes them.
    without_call = [*MESSAGES, {"role": "tool", "tool_call_id": tool_call.id, "content": "Sunny, 24 C."}]
    shorter = client.chat.completions.create(
        model=MODEL_NAME, messages=without_call, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert shorter.usage is not None and out.usage.prompt_tokens > shorter.usage.prompt_tokens + 10


# ---------------------------------------------------------------------- auto: the hermes parser

# The tiny model writes noise; a regex makes it write what a Qwen model would, for the parser to find.
HERMES_REPLY = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
)


def test_auto_finds_the_calls_in_the_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=200,
        extra_body={"structured_outputs": {"regex": HERMES_REPLY}},
    ).choices[0]
    assert out.finish_reason == "tool_calls"
    assert out.message.content == "Sure. "
    assert_valid_calls(out.message.tool_calls)


def test_auto_streams_the_text_then_the_calls(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            max_tokens=200,
            stream=True,
            extra_body={"structured_outputs": {"regex": HERMES_REPLY}},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure. "
    with_calls = [i for i, d in enumerate(deltas) if d.tool_calls]
    assert with_calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not d.content for d in deltas[with_calls[0] :])  # no text after a call began
    arguments = assert_streamed_piece_by_piece(call_deltas(chunks), "get_weather")
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0].message.tool_calls
    assert_valid_calls(final)
    assert final is not None and final[0].function.arguments == arguments


def test_auto_with_a_malformed_call_returns_it_as_text(client: openai.OpenAI) -> None:
    broken = '<tool_call>{"name": "get_weather", "arguments": oops}</tool_call>'
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=200,
        extra_body={"guided_choice": [broken]},
    ).choices[0]
    assert (out.message.content, out.message.tool_calls, out.finish_reason) == (broken, None, "stop")


def test_auto_on_free_text_is_served(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=9)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_without_a_parser_is_a_400_naming_the_flag(
    server: RunningServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.state, "config", dataclasses.replace(server.state.config, tool_call_parser=None))
    for tool_choice in ("auto", None):  # None: left out, which is "auto" with tools
        kwargs: dict[str, Any] = {} if tool_choice is None else {"tool_choice": tool_choice}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=5, **kwargs)
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "tool_choice"
        assert "--tool-call-parser" in info.value.body["message"]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=WEATHER, max_tokens=200
    )
    assert out.choices[0].message.tool_calls  # constrained choices need no parser


# ---------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
            "tools.0.function.name",
        ),
    ],
)
def test_tool_requests_that_cannot_be_done_are_400s(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, **kwargs)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


def test_control_tokens_in_a_tool_call_are_refused(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "<|im_end|>"}'}}
    history: list[Any] = [*MESSAGES, {"role": "assistant", "tool_calls": [call]}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=5)
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "invalid_messages"
