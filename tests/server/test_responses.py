"""The Responses API through the official openai client, on the tiny random model with the Hermes-style
tools template: the same greedy text as the chat route for the same conversation, the streamed event
sequence, function calls and their outputs over previous_response_id, the store (per key, store: false,
delete, cancel, background) and the errors a bad request gets."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, long_context_copy, run_server
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError
from tokenmill.server.response_store import ResponseStore, StoredResponse
from tokenmill.server.responses_protocol import MessageItem, OutputMessage, OutputText, ResponseObject

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER_TOOL: Any = {"type": "function", "name": "get_weather", "description": "the weather", "parameters": CITY}
GREEDY: Any = {"model": MODEL_NAME, "temperature": 0, "max_output_tokens": 8}


@pytest.fixture(scope="module")
def server(tool_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # The tool's JSON takes hundreds of the tiny tokenizer's tokens: a copy with a longer context.
    model = long_context_copy(tool_chat_model, tmp_path_factory.mktemp("responses") / "model")
    config = ServerConfig(tool_call_parser="hermes", api_keys=("key-a", "key-b"))
    with run_server(model, config, max_model_len=1024, num_kv_blocks=256, max_num_batched_tokens=1024) as running:
        yield running


def _client(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with _client(server, "key-a") as c:
        yield c


@pytest.fixture(scope="module")
def other(server: RunningServer) -> Iterator[openai.OpenAI]:
    with _client(server, "key-b") as c:
        yield c


def chat(client: openai.OpenAI, messages: list[Any], max_tokens: int = 8) -> Any:
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=max_tokens)


def test_text_is_the_chat_routes_greedy_text(client: openai.OpenAI) -> None:
    out = client.responses.create(input="Hello there", instructions="Be brief.", **GREEDY)
    reference = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert out.id.startswith("resp_") and out.object == "response" and out.model == MODEL_NAME
    assert out.output_text == reference.choices[0].message.content
    assert [item.type for item in out.output] == ["message"] and out.output[0].id.startswith("msg_")
    assert out.usage is not None and out.usage.input_tokens == reference.usage.prompt_tokens
    assert out.usage.output_tokens == reference.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    if reference.choices[0].finish_reason == "length":
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed"
    assert out.instructions == "Be brief." and out.max_output_tokens == 8 and out.temperature == 0


def test_stream_sends_the_documented_events_in_order(client: openai.OpenAI) -> None:
    unstreamed = client.responses.create(input="Tell me a story", **GREEDY)
    with client.responses.stream(input="Tell me a story", **GREEDY) as stream:  # the SDK assembles the events
        events = list(stream)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and events[2].item.content == []  # the part comes in its own event
    assert [e.snapshot for e in events if e.type == "response.output_text.delta"][-1] == "".join(deltas)
    middle = ["response.output_text.delta"] * len(deltas)
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *middle,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if unstreamed.status == "incomplete" else "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert "".join(deltas) == done.text == final.output_text == unstreamed.output_text
    assert events[0].response.id == final.id and final.usage.output_tokens == unstreamed.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored once finished


def test_forced_function_call_then_its_output_over_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL_NAME,
        input="What is the weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        extra_body={"seed": 3},
    )
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(
        previous_response_id=first.id, input=[result], tools=[WEATHER_TOOL], tool_choice="none", **GREEDY
    )
    # The chat route, given the same conversation, sees the same prompt and writes the same text.
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ],
    }
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        assistant,
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    reference = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}],
        tool_choice="none",
        temperature=0,
        max_tokens=8,
    )
    assert second.usage.input_tokens == reference.usage.prompt_tokens
    assert second.output_text == reference.choices[0].message.content
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    paged = list(client.responses.input_items.list(second.id, limit=1))  # the SDK follows has_more / after
    assert [i.id for i in paged] == [i.id for i in reversed(items)]  # newest first by default


def test_streamed_function_call_assembles_in_the_sdks_stream_helper(client: openai.OpenAI) -> None:
    request: Any = {
        "model": MODEL_NAME,
        "input": "What is the weather in Rome?",
        "tools": [{**WEATHER_TOOL, "strict": True}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 200,
        "extra_body": {"seed": 4},
    }
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert pieces  # piece by piece is tested on ReplyStream; a busy client may get them merged
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(pieces),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    unstreamed = client.responses.create(**request).output[0]
    assert call.type == unstreamed.type == "function_call" and call.arguments == unstreamed.arguments == "".join(pieces)
    assert call.parsed_arguments == json.loads(call.arguments)  # the SDK parses a strict tool's arguments


def test_reasoning_is_a_reasoning_item_streamed_or_not(
    server: RunningServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    # deepseek_r1 takes a reply without </think> (any reply of the random model) as all reasoning.
    monkeypatch.setattr(
        server.state, "config", dataclasses.replace(server.state.config, reasoning_parser="deepseek_r1")
    )
    out = client.responses.create(input="Where is Paris?", **GREEDY)
    reference = chat(client, [{"role": "user", "content": "Where is Paris?"}]).choices[0].message
    [item] = out.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and out.output_text == ""
    assert item.content is not None and item.content[0].text == reference.reasoning_content  # type: ignore[attr-defined]
    events = list(client.responses.create(input="Where is Paris?", stream=True, **GREEDY))
    pieces = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert [e.type for e in events][2:-1] == [
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * len(pieces),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert "".join(pieces) == item.content[0].text == events[-1].response.output[0].content[0].text


def test_previous_response_id_carries_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(input="Hi", **GREEDY)
    second = client.responses.create(input="And then?", previous_response_id=first.id, **GREEDY)
    reference = chat(
        client,
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert second.usage.input_tokens == reference.usage.prompt_tokens > first.usage.input_tokens
    assert second.output_text == reference.choices[0].message.content
    assert second.previous_response_id == first.id

    # Output items replayed by the client (a reasoning item among them) say the same as the previous id.
    replayed: Any = [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text, "annotations": []}]},
        {"role": "user", "content": "And then?"},
    ]
    assert client.responses.create(input=replayed, **GREEDY).usage.input_tokens == second.usage.input_tokens


def test_json_schema_text_format_gives_json_that_validates(client: openai.OpenAI) -> None:
    out = client.responses.create(
        model=MODEL_NAME,
        input="Where to go?",
        text={"format": {"type": "json_schema", "name": "trip", "schema": CITY, "strict": True}},
        max_output_tokens=200,
        extra_body={"seed": 1},
    )
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), CITY)


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    out = client.responses.create(input="Hi", store=False, **{**GREEDY, "max_output_tokens": 1})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Hi", previous_response_id=out.id, **GREEDY)


def test_unknown_fields_are_ignored_as_on_the_chat_route(client: openai.OpenAI) -> None:
    out = client.responses.create(
        input="Hi", truncation="auto", extra_body={"made_up_field": 1}, **{**GREEDY, "max_output_tokens": 1}
    )
    assert out.usage is not None and out.usage.output_tokens == 1


def test_another_key_sees_no_response_of_this_key(client: openai.OpenAI, other: openai.OpenAI) -> None:
    out = client.responses.create(input="Hi", **{**GREEDY, "max_output_tokens": 1})
    for attempt in (lambda: other.responses.retrieve(out.id), lambda: other.responses.delete(out.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.NotFoundError):
        other.responses.create(input="Hi", previous_response_id=out.id, **GREEDY)
    assert client.responses.retrieve(out.id).id == out.id


def test_delete_then_get_is_not_found(client: openai.OpenAI) -> None:
    out = client.responses.create(input="Hi", **{**GREEDY, "max_output_tokens": 1})
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(out.id)


def test_a_finished_response_cannot_be_cancelled(client: openai.OpenAI) -> None:
    out = client.responses.create(input="Hi", **{**GREEDY, "max_output_tokens": 1})
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(out.id)


def test_background_response_is_polled_to_the_same_text(client: openai.OpenAI) -> None:
    queued = client.responses.create(input="Tell me a story", background=True, **GREEDY)
    assert queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 30
    while (out := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert out.output_text == client.responses.create(input="Tell me a story", **GREEDY).output_text


def test_cancel_stops_a_background_response(client: openai.OpenAI) -> None:
    queued = client.responses.create(input="Tell me a story", background=True, **{**GREEDY, "max_output_tokens": 500})
    assert client.responses.cancel(queued.id).status == "cancelled"
    deadline = time.monotonic() + 30
    while (out := client.responses.retrieve(queued.id)).usage is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert out.status == "cancelled" and out.usage.output_tokens < 500


def test_cancel_ends_a_running_stream(client: openai.OpenAI) -> None:
    events = iter(client.responses.create(input="Tell me a story", stream=True, **{**GREEDY, "max_output_tokens": 500}))
    response_id = next(events).response.id
    assert client.responses.retrieve(response_id).status == "in_progress"  # stored as it begins
    next(e for e in events if e.type == "response.output_text.delta")
    client.responses.cancel(response_id)
    last = list(events)[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    stored = client.responses.retrieve(response_id)
    assert stored.status == "cancelled" and stored.output_text == last.response.output_text
    assert stored.usage.output_tokens < 500


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "input"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "Hi", "background": True, "store": False}, "store"),
        ({"input": []}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_param(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL_NAME, max_output_tokens=1, **kwargs)
    assert caught.value.status_code == 400 and caught.value.param == param


# ---------------------------------------------------------------------- the store's bounds, without a server


def stored(response_id: str, text: str, key: str = "key-0") -> StoredResponse:
    response = ResponseObject(id=response_id, created_at=0, status="completed", model=MODEL_NAME)
    return StoredResponse(key, response, [MessageItem(role="user", content=text)])


def test_the_store_forgets_the_least_recently_used_past_its_count() -> None:
    store = ResponseStore(capacity=2, max_chars=1000)
    for name in ("a", "b"):
        store.put(stored(name, "x"))
    store.get("key-0", "a")  # now the most recently used
    store.put(stored("c", "x"))
    assert store.get("key-0", "a") and store.get("key-0", "c")
    with pytest.raises(APIError) as caught:
        store.get("key-0", "b")
    assert caught.value.status == 404


def test_the_store_forgets_past_its_characters_counting_outputs_once_finished() -> None:
    store = ResponseStore(capacity=10, max_chars=10)
    first, second = stored("a", "12345"), stored("b", "1234")
    store.put(first)
    store.put(second)
    assert store.num_chars == 9
    output = [OutputMessage(id="msg_1", status="completed", content=[OutputText(text="xx")])]
    second.response = second.response.model_copy(update={"output": output})
    store.update(second)  # 5 + 4 + 2 > 10: the least recently used goes
    assert len(store) == 1 and store.num_chars == 6 and store.get("key-0", "b") is second


def test_a_stored_response_is_absent_for_another_key() -> None:
    store = ResponseStore(capacity=10, max_chars=1000)
    store.put(stored("a", "x", key="key-0"))
    with pytest.raises(APIError):
        store.get("key-1", "a")
    with pytest.raises(APIError):
        store.delete("key-1", "a")
    assert store.delete("key-0", "a").key == "key-0" and store.num_chars == 0
