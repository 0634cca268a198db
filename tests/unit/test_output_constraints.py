"""Request fields to the engine's output constraint (StructuredOutputsParams): response_format,
structured_outputs, the guided_* names, and the JSON schema of tool_choice "required" or a named
function; one constraint per request. Through a server: tests/server/test_structured_outputs.py and
tests/server/test_tool_calls.py."""

from __future__ import annotations

import json
import logging
from typing import Any

import jsonschema
import pytest

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server import strict
from tokenmill.server.constraints import output_constraint
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.tools import constrained_calls, plan_tools, template_message
from tokenmill.structured.limits import MAX_GRAMMAR_BYTES_CEILING, GrammarLimits

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def constraint(body: ChatCompletionRequest) -> StructuredOutputsParams | None:
    plan = plan_tools(body, None)
    return output_constraint(body, body.response_format, plan.schema)


# ---------------------------------------------------------------------- one field each


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}},
            StructuredOutputsParams(json=CITY),
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
        ({"structured_outputs": {"json": CITY}}, StructuredOutputsParams(json=CITY)),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
        ({"guided_json": CITY}, StructuredOutputsParams(json=CITY)),
        ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_grammar": 'start: "x"'}, StructuredOutputsParams(grammar='start: "x"')),
    ],
)
def test_each_field_maps_to_its_constraint(fields: dict[str, Any], expected: StructuredOutputsParams | None) -> None:
    assert constraint(chat(**fields)) == expected


def test_completions_take_structured_outputs_and_the_guided_names() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["a", "b"]})
    assert output_constraint(body) == StructuredOutputsParams(choice=["a", "b"])


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": CITY}, "guided_json"),
        ({"guided_choice": ["a"], "tools": [tool("f")], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_two_constraints_are_a_400_naming_the_second(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        constraint(chat(**fields))
    assert (info.value.status, info.value.param, info.value.code) == (400, param, "conflicting_constraints")


@pytest.mark.parametrize("so", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}])
def test_a_structured_outputs_without_exactly_one_field_is_a_400(so: dict[str, Any]) -> None:
    with pytest.raises(APIError) as info:
        constraint(chat(structured_outputs=so))
    assert (info.value.status, info.value.param) == (400, "structured_outputs")


# ---------------------------------------------------------------------- size caps

BIG = "x" * ((64 << 10) + 1)  # one byte over the default cap


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"guided_choice": [f"c{i}" for i in range(1001)]}, "guided_choice", "1001 choices"),
        ({"structured_outputs": {"choice": ["a", BIG]}}, "structured_outputs", "at most 65536"),
        ({"guided_regex": BIG}, "guided_regex", "regex is 65537 bytes"),
        ({"guided_grammar": f'start: "{BIG}"'}, "guided_grammar", "at most 65536"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [BIG]}}}},
            "response_format",
            "json is 65551 bytes",
        ),
    ],
)
def test_a_constraint_over_the_caps_is_a_400_naming_its_field(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(APIError) as info:
        constraint(chat(**fields))
    assert (info.value.status, info.value.param, info.value.code) == (400, param, "grammar_too_large")
    assert words in info.value.message


def test_the_tools_schema_counts_against_the_cap() -> None:
    body = chat(tools=[tool(f"f{i}", CITY) for i in range(100)], tool_choice="required")
    plan = plan_tools(body, None)
    assert output_constraint(body, None, plan.schema) is not None  # within the default cap
    with pytest.raises(APIError) as info:
        output_constraint(body, None, plan.schema, GrammarLimits(max_bytes=4096))
    assert info.value.param == "tool_choice"


def test_caps_at_the_limit_pass_and_bad_caps_are_refused() -> None:
    exactly = "x" * ((64 << 10) - 4)  # as a JSON list: 65536 bytes
    assert constraint(chat(guided_choice=[exactly])) is not None
    assert constraint(chat(guided_choice=[f"c{i}" for i in range(1000)])) is not None
    for bad in ({"max_bytes": 0}, {"max_bytes": MAX_GRAMMAR_BYTES_CEILING + 1}, {"max_choices": 0}):
        with pytest.raises(ValueError, match="--max-grammar"):
            GrammarLimits(**bad)


# ---------------------------------------------------------------------- tool_choice


def test_required_constrains_to_an_array_of_calls_of_the_given_tools() -> None:
    body = chat(tools=[tool("get_weather", CITY), tool("get_time")], tool_choice="required")
    schema = plan_tools(body, None).schema
    assert schema is not None
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "get_weather", "arguments": {"city": "Paris"}}])
    assert validator.is_valid(
        [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]
    )
    assert not validator.is_valid([])  # at least one call
    assert not validator.is_valid([{"name": "get_weather", "arguments": {"city": "Oslo"}}])  # not the enum
    assert not validator.is_valid([{"name": "get_time", "arguments": {"x": 1}}])  # no arguments
    assert not validator.is_valid([{"name": "other", "arguments": {}}])


def test_required_without_parallel_calls_allows_one_call() -> None:
    body = chat(tools=[tool("get_time")], tool_choice="required", parallel_tool_calls=False)
    schema = plan_tools(body, None).schema
    assert schema is not None and schema["maxItems"] == 1


def test_required_moves_each_tools_defs_to_the_root_where_refs_point() -> None:
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"enum": [1, 2]}}}
    schema = plan_tools(chat(tools=[tool("f", params)], tool_choice="required"), None).schema
    assert schema is not None and schema["$defs"] == {"P": {"enum": [1, 2]}}
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "f", "arguments": {"p": 1}}])
    assert not validator.is_valid([{"name": "f", "arguments": {"p": 3}}])


def test_required_refuses_tools_that_define_the_same_def_differently() -> None:
    a = {"type": "object", "$defs": {"P": {"type": "string"}}}
    b = {"type": "object", "$defs": {"P": {"type": "integer"}}}
    with pytest.raises(APIError) as info:
        plan_tools(chat(tools=[tool("a", a), tool("b", b)], tool_choice="required"), None)
    assert (info.value.status, info.value.param) == (400, "tools")


def test_a_named_function_constrains_to_its_parameters() -> None:
    body = chat(
        tools=[tool("get_weather", CITY)], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    plan = plan_tools(body, None)
    assert plan.schema == CITY and plan.function == "get_weather"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [tool("f")]}, "tool_choice"),  # auto, the default with tools, without a parser
        ({"tools": [tool("f"), tool("f")], "tool_choice": "required"}, "tools"),
    ],
)
def test_tool_choices_that_cannot_be_done_are_400s(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(chat(**fields), None)
    assert (info.value.status, info.value.param) == (400, param)


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt() -> None:
    plan = plan_tools(chat(tools=[tool("f")], tool_choice="none"), None)
    assert plan.template_tools is None and plan.schema is None


def test_constrained_output_becomes_calls_and_a_cut_one_does_not() -> None:
    body = chat(tools=[tool("get_weather", CITY)], tool_choice="required")
    plan = plan_tools(body, None)
    calls = constrained_calls(plan, '[{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"})
    ]
    assert constrained_calls(plan, '[{"name": "get_weather", "arguments": {"ci') is None


def test_history_tool_calls_reach_the_template_with_their_arguments_as_objects() -> None:
    body = chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    assistant, answer = (template_message(m) for m in body.messages[1:])
    assert assistant == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}],
    }
    assert answer == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


# ---------------------------------------------------------------------- unknown fields


def test_an_unknown_field_is_ignored_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    strict._warned.discard("ChatCompletionRequest.frobnicate")
    with caplog.at_level(logging.WARNING, logger="tokenmill.server.strict"):
        chat(frobnicate=1)
        chat(frobnicate=2)
    warnings = [r for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(warnings) == 1
