"""A request's output constraint, from whichever field asks for one: `response_format` (chat), vLLM's
`structured_outputs` or its older `guided_*` fields, or tool_choice "required" / a named function (the
tools' JSON schema, tools.py). One per request: two are a 400, since which should win is not ours to guess.
A constraint over this server's caps (--max-grammar-bytes, --max-grammar-choices) is a 400 naming its field.
Whether a schema, regex or grammar compiles is the engine's check, made on a compile thread within
--grammar-compile-timeout (`check_compiles`; a ValueError there is a 400 too)."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import _SamplingFields
from tokenmill.server.protocol_tools import ResponseFormat
from tokenmill.structured.backend import GrammarChecker
from tokenmill.structured.compile_threads import COMPILE_THREADS
from tokenmill.structured.limits import DEFAULT_GRAMMAR_LIMITS, GrammarLimits

_GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


def output_constraint(
    body: _SamplingFields,
    response_format: ResponseFormat | None = None,
    tool_schema: dict[str, Any] | None = None,
    limits: GrammarLimits = DEFAULT_GRAMMAR_LIMITS,
) -> StructuredOutputsParams | None:
    """The request's one constraint as the engine takes it, or None; APIError 400 for two, a bad one,
    or one over `limits`."""
    asked = _asked(body, response_format)
    if tool_schema is not None:
        asked.append(("tool_choice", {"json": tool_schema}))
    if len(asked) > 1:
        first, second = asked[0][0], asked[1][0]
        raise APIError(
            400,
            f"{first} and {second} both constrain the output; a request may give only one of response_format "
            "(json_object or json_schema), structured_outputs, guided_json/regex/choice/grammar, and tool_choice "
            '"required" or a named function.',
            "conflicting_constraints",
            second,
        )
    if not asked:
        return None
    field, kwargs = asked[0]
    try:
        spec = StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_structured_outputs", field) from exc
    try:
        limits.check(spec)
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", "grammar_too_large", field) from exc
    return spec


async def check_compiles(checker: GrammarChecker, spec: StructuredOutputsParams, timeout_s: float) -> None:
    """Whether `spec` compiles, checked on a compile thread (never the event loop's or the prompt
    thread's time); ValueError for one that does not, APIError 400 for one that takes longer than
    `timeout_s` (the check itself cannot be stopped: it ends on its thread, and its verdict is kept)."""
    try:
        await asyncio.wait_for(asyncio.wrap_future(COMPILE_THREADS.submit(checker.check, spec)), timeout_s)
    except asyncio.TimeoutError as exc:
        raise APIError(
            400,
            f"the output constraint ({spec.kind}) did not compile within {timeout_s:g} s "
            "(--grammar-compile-timeout); give a smaller or simpler schema, regex or grammar.",
            "grammar_compile_timeout",
        ) from exc


def _asked(body: _SamplingFields, response_format: ResponseFormat | None) -> list[tuple[str, dict[str, Any]]]:
    """(field, StructuredOutputsParams' keyword arguments) for each field that asks for a constraint."""
    asked: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None and response_format.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        schema = response_format.json_schema.schema_
        asked.append(("response_format", {"json_object": True} if schema is None else {"json": schema}))
    so = body.structured_outputs
    if so is not None:
        kwargs: dict[str, Any] = {
            key: value
            for key, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))
            if value is not None
        }
        if so.json_object:
            kwargs["json_object"] = True
        asked.append(("structured_outputs", kwargs))
    for field, key in _GUIDED:
        value = getattr(body, field)
        if value is not None:
            asked.append((field, {key: value}))
    return asked
