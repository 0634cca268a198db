"""Tool calls found in a model's free text (tool_choice "auto"): the Hermes and Llama 3 JSON formats,
whole and streamed (a call's name, then its arguments piece by piece). Malformed calls come back as
plain content, never as an error."""

from __future__ import annotations

import json

import pytest

from tokenmill.server.tool_output import ReplyStream
from tokenmill.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ParsedCall,
    ParsedOutput,
    ToolCallStream,
    ToolParser,
)
from tokenmill.server.tool_stream import ArgumentsScanner, CallPiece, CallsScanner
from tokenmill.server.tools import ToolPlan

hermes, llama3 = HermesParser(), Llama3JsonParser()
WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')


# ---------------------------------------------------------------------- hermes (Qwen2.5, Qwen3)


def test_hermes_finds_one_call_and_keeps_the_text_before_it() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert hermes.parse(text) == ParsedOutput("Let me look.\n", [WEATHER])


def test_hermes_finds_several_calls_and_no_content_between_them() -> None:
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert hermes.parse(text) == ParsedOutput(None, [WEATHER, ParsedCall("get_time", "{}")])


def test_hermes_takes_a_last_call_without_its_closing_tag() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert hermes.parse(text) == ParsedOutput(None, [WEATHER])


def test_hermes_takes_arguments_given_as_json_text() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    assert hermes.parse(text).calls == [WEATHER]


@pytest.mark.parametrize(
    "text",
    [
        "no tool call here",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>',  # cut JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>',  # infinity is not JSON
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops</tool_call>',  # one bad call of two
        "<tool_call>" + "[" * 100_000,  # deeper than the JSON parser goes
    ],
)
def test_hermes_malformed_calls_are_plain_content(text: str) -> None:
    assert hermes.parse(text) == ParsedOutput(text, [])


# ---------------------------------------------------------------------- llama3_json (Llama 3.1-3.3)


def test_llama3_finds_a_call_with_parameters() -> None:
    assert llama3.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}') == ParsedOutput(None, [WEATHER])


def test_llama3_skips_the_python_tag_and_takes_arguments_too() -> None:
    text = '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert llama3.parse(text) == ParsedOutput(None, [WEATHER])


def test_llama3_finds_calls_separated_by_semicolons() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    assert llama3.parse(text).calls == [WEATHER, ParsedCall("get_time", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is fine.",
        'Here: {"name": "get_weather", "parameters": {}}',  # a call must be the whole reply
        '{"name": "get_weather", "parameters": {}} and some text',
        '{"name": "get_weather", "parameters": {"city": "Par',  # cut by max_tokens
        '{"city": "Paris"}',  # JSON, but no call
    ],
)
def test_llama3_anything_but_calls_is_plain_content(text: str) -> None:
    assert llama3.parse(text) == ParsedOutput(text, [])


# ---------------------------------------------------------------------- streaming


def stream(parser: ToolParser, text: str, size: int) -> tuple[list[str], str, list[ParsedCall]]:
    """The content pieces sent as `text` arrives `size` characters at a time, then what finish() sends."""
    s = ToolCallStream(parser)
    pieces = [s.feed(text[i : i + size]) for i in range(0, len(text), size)]
    rest, calls = s.finish()
    return pieces, rest, calls


HERMES_TEXTS = [
    'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> done',
    'a < b, <tool_ is not a tag <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    "<tool_call>{broken</tool_call> then text",
    "plain text that ends in <tool_",
]


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_stream_sends_what_the_whole_parse_finds(text: str, size: int) -> None:
    pieces, rest, calls = stream(hermes, text, size)
    whole = hermes.parse(text)
    assert "".join(pieces) + rest == (whole.content or "")
    assert calls == whole.calls


def test_hermes_stream_sends_the_text_before_a_call_before_the_call_ends() -> None:
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    pieces, rest, calls = stream(hermes, text, 1)
    sent_before_end = "".join(pieces)
    assert sent_before_end == "Sure. "
    assert rest == "" and calls == [WEATHER]


def test_hermes_stream_holds_back_only_what_may_start_a_tag() -> None:
    s = ToolCallStream(hermes)
    assert s.feed("x <tool") == "x "
    assert s.feed("box>") == "<toolbox>"


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(
    "text",
    [
        '  {"name": "get_weather", "parameters": {"city": "Paris"}}',
        "<|python_tag|>" + '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "  Paris is sunny.",
        "{not json",
    ],
)
def test_llama3_stream_sends_what_the_whole_parse_finds(text: str, size: int) -> None:
    pieces, rest, calls = stream(llama3, text, size)
    whole = llama3.parse(text)
    assert "".join(pieces) + rest == (whole.content or "")
    assert calls == whole.calls


def test_llama3_stream_sends_plain_text_at_once() -> None:
    s = ToolCallStream(llama3)
    assert s.feed("Paris") == "Paris"
    assert s.feed(' {"name": "x"}') == ' {"name": "x"}'  # a reply that began as text is not a call


def test_streamed_arguments_are_json_objects() -> None:
    _, _, calls = stream(hermes, HERMES_TEXTS[0], 3)
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}]


# ---------------------------------------------------------------------- calls streamed piece by piece


def call_pieces(pieces: list[CallPiece]) -> list[tuple[str, str]]:
    """(name, arguments' text joined) per call, checking that each call's name comes in its first piece."""
    calls: list[tuple[str, str]] = []
    for piece in pieces:
        if piece.name is not None:
            assert piece.index == len(calls) and piece.arguments == ""
            calls.append((piece.name, ""))
        else:
            name, arguments = calls[piece.index]
            calls[piece.index] = (name, arguments + piece.arguments)
    return calls


TWO_CALLS = (
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r\\"is", "n": [1, {"x": 2.5}]}}\n'
    '</tool_call>\n<tool_call>{"arguments": "{\\"zone\\": \\"CET\\"}", "name": "get_time"}</tool_call>'
)


@pytest.mark.parametrize("size", [1, 2, 7, 1000])
def test_hermes_calls_stream_as_names_then_pieces_of_their_arguments(size: int) -> None:
    s = ToolCallStream(hermes)
    steps = [s.step(TWO_CALLS[i : i + size]) for i in range(0, len(TWO_CALLS), size)]
    whole = hermes.parse(TWO_CALLS).calls
    assert call_pieces([p for _, pieces in steps for p in pieces]) == [(c.name, c.arguments) for c in whole]
    assert whole[1].arguments == '{"zone": "CET"}'  # arguments given as a JSON string: its text, whole
    if size == 1:  # the first call's arguments came in many pieces, before its call ended
        assert sum(1 for _, pieces in steps for p in pieces if p.index == 0 and p.name is None) > 10


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[{"name": "a", "arguments": {"x": 12}}, {"name": "b"}]', [("a", '{"x": 12}'), ("b", "{}")]),
        ('[{"arguments": {"y": [true]}, "name": "c"}]', [("c", '{"y": [true]}')]),  # the name after its arguments
        (
            '{"name": "d", "parameters": {"z": "}"}}; {"name": "e", "parameters": {}}',
            [("d", '{"z": "}"}'), ("e", "{}")],
        ),
    ],
)
def test_json_sequences_of_calls_stream_piece_by_piece(text: str, expected: list[tuple[str, str]]) -> None:
    scanner = CallsScanner()
    assert call_pieces([p for char in text for p in scanner.feed(char)]) == expected


def test_a_named_functions_output_streams_as_its_arguments_without_surrounding_space() -> None:
    scanner = ArgumentsScanner("get_weather")
    text = ' \n{"city": "Paris"} \n'
    assert call_pieces([p for char in text for p in scanner.feed(char)]) == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_reply_stream_sends_calls_as_pieces_or_whole_with_the_same_arguments(size: int) -> None:
    plan = ToolPlan("auto", parser=hermes)
    pieces, whole = ReplyStream(plan), ReplyStream(plan)
    chunks = [TWO_CALLS[i : i + size] for i in range(0, len(TWO_CALLS), size)]
    deltas = [pieces.advance(c) for c in chunks] + [pieces.close("stop")]
    content = "".join(whole.feed(c) for c in chunks)
    rest, calls, finish_reason = whole.finish("stop")
    assert (content + rest, finish_reason, deltas[-1].finish_reason) == ("Sure. ", "tool_calls", "tool_calls")
    streamed: dict[int, str] = {}
    for entry in (e for d in deltas for e in d.tool_calls):
        streamed[entry["index"]] = streamed.get(entry["index"], "") + entry["function"]["arguments"]
    assert calls is not None and [c["function"]["arguments"] for c in calls] == [streamed[0], streamed[1]]
    assert [c.arguments for c in hermes.parse(TWO_CALLS).calls] == [streamed[0], streamed[1]]


def test_a_call_that_breaks_off_keeps_what_streamed_and_the_engines_finish_reason() -> None:
    stream = ReplyStream(ToolPlan("auto", parser=hermes))
    first = stream.advance('<tool_call>{"name": "get_weather", "arguments": {"ci')
    last = stream.close("length")
    assert [e["function"] for e in first.tool_calls] == [{"name": "get_weather", "arguments": '{"ci'}]
    assert (last.content, last.tool_calls, last.finish_reason) == ("", [], "length")


def test_a_call_whose_arguments_are_not_json_streams_as_the_content_it_is() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": oops}</tool_call>'
    stream = ReplyStream(ToolPlan("auto", parser=hermes))
    deltas = [stream.advance(char) for char in text] + [stream.close("stop")]
    assert "".join(d.content for d in deltas) == text and not any(d.tool_calls for d in deltas)
    assert deltas[-1].finish_reason == "stop"
