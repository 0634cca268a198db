"""Anthropic's Messages API through the official anthropic SDK, on the tiny random model with a Hermes-style
tool template (conftest.HERMES_TOOLS_TEMPLATE), on a server that needs a key: replies equal the chat
route's for the same conversation (streamed or not), tool_use blocks whose input follows the tool's
schema, tool results templated as the chat route templates tool messages, stop reasons, count_tokens,
x-api-key and Bearer auth, and Anthropic's error bodies for bad input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, long_context_copy, run_server
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError
from tokenmill.server.messages_stream import ContentBlocks, event, stream_frames
from tokenmill.server.security import LoginThrottle
from tokenmill.server.tool_output import ReplyDelta

KEY = "test-key"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}]
SYSTEM = "You answer briefly."
QUESTION = "What is the weather in Paris?"
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server(tool_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # The tools' JSON takes hundreds of the tiny tokenizer's tokens: a copy with a longer context.
    model = long_context_copy(tool_chat_model, tmp_path_factory.mktemp("messages") / "model")
    config = ServerConfig(tool_call_parser="hermes", api_keys=(KEY,), max_body_bytes=MAX_BODY_BYTES)
    with run_server(model, config, max_model_len=2048, num_kv_blocks=256, max_num_batched_tokens=1024) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_chat(server: RunningServer) -> openai.types.chat.ChatCompletion:
    """The chat route's greedy reply to SYSTEM + QUESTION: what /v1/messages must answer too."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as chat:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        return chat.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)


# The SDK no longer has sampling arguments (Claude's newest models take none); the API still does.
GREEDY = {"temperature": 0.0}


def ask(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    fields: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 8, "system": SYSTEM, "extra_body": GREEDY}
    fields["messages"] = [{"role": "user", "content": QUESTION}]
    return client.messages.create(**(fields | kwargs))


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# ---------------------------------------------------------------------- text


def test_reply_equals_the_chat_routes_greedy_reply(client: anthropic.Anthropic, greedy_chat: Any) -> None:
    message = ask(client)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL_NAME
    assert text_of(message) == greedy_chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[greedy_chat.choices[0].finish_reason]
    usage = message.usage
    assert usage.output_tokens == greedy_chat.usage.completion_tokens
    # Anthropic counts cached prompt tokens apart: the prompt is their sum.
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == greedy_chat.usage.prompt_tokens


def test_system_as_text_blocks_equals_system_as_a_string(client: anthropic.Anthropic, greedy_chat: Any) -> None:
    message = ask(client, system=[{"type": "text", "text": SYSTEM}])
    assert text_of(message) == greedy_chat.choices[0].message.content


def test_streamed_text_joins_into_the_final_message(client: anthropic.Anthropic, greedy_chat: Any) -> None:
    fields: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 8, "system": SYSTEM, "extra_body": GREEDY}
    with client.messages.stream(messages=[{"role": "user", "content": QUESTION}], **fields) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert pieces  # one or more: outputs that pile up behind a busy client come merged
    assert "".join(pieces) == text_of(final) == greedy_chat.choices[0].message.content
    assert final.id.startswith("msg_") and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens == greedy_chat.usage.completion_tokens


def test_stream_events_come_in_anthropics_order(client: anthropic.Anthropic) -> None:
    events = list(ask(client, stream=True))
    types = [event.type for event in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1:3] == ["content_block_start", "content_block_delta"]
    assert types[-3] == "content_block_stop"
    assert set(types[2:-3]) == {"content_block_delta"}
    start = events[0]
    assert start.type == "message_start" and start.message.usage.input_tokens > 0
    assert start.message.content == [] and start.message.stop_reason is None


def test_stop_sequence_ends_the_reply_and_is_named(client: anthropic.Anthropic, greedy_chat: Any) -> None:
    text = greedy_chat.choices[0].message.content
    assert len(text) >= 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    message = ask(client, stop_sequences=["never in the text", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == text[: text.index(stop)]


def test_max_tokens_ends_the_reply_with_stop_reason_max_tokens(client: anthropic.Anthropic) -> None:
    message = ask(client, max_tokens=2)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 2


def test_output_config_format_constrains_the_text_to_the_schema(client: anthropic.Anthropic) -> None:
    output_config: Any = {"format": {"type": "json_schema", "schema": CITY}}
    message = ask(client, output_config=output_config, max_tokens=64)
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(message)), CITY)


def test_reasoning_thinking_text_and_a_call_stream_as_blocks_in_order() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}
    blocks = ContentBlocks()
    frames = [
        *blocks.send(ReplyDelta(reasoning="Hmm")),
        *blocks.send(ReplyDelta(reasoning=", Paris.", content="It is")),
        *blocks.send(ReplyDelta(content=" sunny.", tool_calls=[call])),
        *blocks.send(ReplyDelta(tool_calls=[{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}])),
        *blocks.stop(),
    ]
    events = [json.loads(frame.split("data: ", 1)[1]) for frame in frames]
    assert all(frame.startswith(f"event: {e['type']}\n") for frame, e in zip(frames, events))
    started = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert started == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    deltas = [(e["index"], *e["delta"].values()) for e in events if e["type"] == "content_block_delta"]
    assert deltas == [
        (0, "thinking_delta", "Hmm"),
        (0, "thinking_delta", ", Paris."),
        (1, "text_delta", "It is"),
        (1, "text_delta", " sunny."),
        (2, "input_json_delta", '{"ci'),
        (2, "input_json_delta", 'ty": "Paris"}'),
    ]


def test_an_error_after_the_stream_began_is_an_error_event() -> None:
    async def events() -> AsyncIterator[str]:
        yield event({"type": "ping"})
        raise APIError(504, "the request timed out.", "request_timeout")

    async def collect() -> list[str]:
        return [frame async for frame in stream_frames(events())]

    frames = asyncio.run(collect())
    assert frames[-1].startswith("event: error\n")
    body = json.loads(frames[-1].split("data: ", 1)[1])
    assert body == {"type": "error", "error": {"type": "timeout_error", "message": "the request timed out."}}


# ---------------------------------------------------------------------- tools


def test_named_tool_choice_gives_a_tool_use_block(client: anthropic.Anthropic) -> None:
    tool_choice: Any = {"type": "tool", "name": "get_weather"}
    message = ask(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=64)
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert isinstance(call.input, dict)
    jsonschema.validate(call.input, CITY)


def test_streamed_tool_use_assembles_into_the_final_message(client: anthropic.Anthropic) -> None:
    tool_choice: Any = {"type": "any", "disable_parallel_tool_use": True}
    fields: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 64, "tools": TOOLS, "tool_choice": tool_choice}
    with client.messages.stream(messages=[{"role": "user", "content": QUESTION}], **fields) as stream:
        pieces = [event.partial_json for event in stream if event.type == "input_json"]
        final = stream.get_final_message()
    assert pieces  # piece by piece is tested on ReplyStream; a busy client may get them merged
    assert final.stop_reason == "tool_use"
    (call,) = [block for block in final.content if block.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, CITY)
    assert json.loads("".join(pieces)) == call.input


def test_tool_result_turn_is_templated_as_the_chat_routes_tool_message(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 25 C"}]}
    messages: list[Any] = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call]},
        {"role": "user", "content": [result]},
    ]
    message = ask(client, messages=messages, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=4)
    chat_messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 25 C"},
    ]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as chat:
        expected = chat.chat.completions.create(model=MODEL_NAME, messages=chat_messages, max_tokens=4, temperature=0)
    assert text_of(message) == expected.choices[0].message.content
    assert expected.usage is not None
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == expected.usage.prompt_tokens


def test_count_tokens_equals_the_requests_input_tokens(client: anthropic.Anthropic) -> None:
    tool_choice: Any = {"type": "tool", "name": "get_weather"}
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(
        model=MODEL_NAME, system=SYSTEM, messages=messages, tools=TOOLS, tool_choice=tool_choice
    )
    message = ask(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=64)
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    without_tools = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=messages)
    assert counted.input_tokens > without_tools.input_tokens  # the tools are in the prompt


# ---------------------------------------------------------------------- auth and errors


def test_x_api_key_and_bearer_both_authenticate(server: RunningServer) -> None:
    with anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0) as bearer:
        assert bearer.messages.count_tokens(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as x_api_key:
        assert x_api_key.messages.count_tokens(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])


def test_a_wrong_key_is_an_authentication_error(server: RunningServer) -> None:
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key."},
    }


def test_a_throttled_address_is_a_rate_limit_error(
    client: anthropic.Anthropic, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.state, "throttle", LoginThrottle(max_failures=1))  # restored after the test
    hi: Any = [{"role": "user", "content": "hi"}]
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.count_tokens(model=MODEL_NAME, messages=hi)
    with pytest.raises(anthropic.RateLimitError) as caught:  # the right key too, from this address
        client.messages.count_tokens(model=MODEL_NAME, messages=hi)
    assert caught.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(caught.value.response.headers["retry-after"]) >= 1


def bad_request(client: anthropic.Anthropic, body: dict[str, Any]) -> dict[str, Any]:
    """The error body of a request the SDK's typed methods would not send."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", cast_to=anthropic.types.Message, body=body)
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and caught.value.status_code == 400
    return dict(error["error"])


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}
                ],
            },
            "image content blocks are not supported",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled"}},
            "thinking",
        ),
    ],
    ids=["no-max-tokens", "bad-role", "image-block", "thinking"],
)
def test_bad_input_is_a_bad_request_error(client: anthropic.Anthropic, body: dict[str, Any], says: str) -> None:
    assert says in bad_request(client, {"model": MODEL_NAME, **body})["message"]


def test_an_unknown_model_is_a_not_found_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-nonesuch", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_a_body_over_the_limit_is_anthropics_request_too_large(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}
    response = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, content=json.dumps(body))
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"
