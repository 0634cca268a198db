"""POST /v1/chat/completions: messages through the model's chat template, streamed or not; with tools,
the reply's tool calls (tools.py, tool_output.py); with --reasoning-parser, its reasoning (reasoning.py).
A request goes parse (the body, its tools and constraint) -> prepare (the engine's shared preparation,
prepare.py) -> admit -> stream or finish."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.engine.chat_template import check_template_kwargs
from tokenmill.engine.input_processor import PreparedRequest
from tokenmill.outputs import TokenLogprobs
from tokenmill.server.admission import admit
from tokenmill.server.config import ServerState
from tokenmill.server.constraints import output_constraint
from tokenmill.server.errors import APIError
from tokenmill.server.job import Job, run_job
from tokenmill.server.limits import check_logit_bias, check_n
from tokenmill.server.prepare import prepare
from tokenmill.server.prompts import chat_token_ids, check_messages_size
from tokenmill.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    MediaPart,
    TokenLogprobEntry,
    TopLogprob,
    new_id,
    now,
)
from tokenmill.server.reasoning import PROMPT_TAIL_TOKENS
from tokenmill.server.sampling import sampling_params
from tokenmill.server.streaming import JobStreamingResponse, finish, sse
from tokenmill.server.token_text import decoded, finite
from tokenmill.server.tool_output import ReplyDelta, ReplyStream, whole_reply
from tokenmill.server.tools import ToolPlan, plan_tools, template_message


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request, key: str) -> Any:
    arrival = time.monotonic()
    request_id = new_id("chatcmpl")
    with state.limiter.charging_refusals(key):
        prepared, plan = await prepare_chat(state, body, key, request_id)
        job = admit(state, key, [prepared], arrival, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return JobStreamingResponse(state, job, _stream(state, body, plan, job, request_id, include_usage))
    await finish(state, job, request)
    response = chat_response(state, body, plan, job, request_id)
    return JSONResponse(response.model_dump(), headers=job.admission.headers)


def chat_response(
    state: ServerState, body: ChatCompletionRequest, plan: ToolPlan, job: Job, request_id: str
) -> ChatCompletionResponse:
    """The unstreamed reply of a finished job (also what the Batch API writes for a chat line)."""
    top = (body.top_logprobs or 0) if body.logprobs else None
    choices = []
    for out in job.outputs[0].outputs:
        reply = whole_reply(plan, out.text, out.finish_reason)
        choices.append(
            ChatChoice(
                index=out.index,
                message=AssistantMessage(
                    content=reply.content, tool_calls=reply.tool_calls, reasoning_content=reply.reasoning
                ),
                logprobs=_logprobs(state, out.token_ids, out.logprobs or [], top) if top is not None else None,
                finish_reason=reply.finish_reason,
                stop_reason=out.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=request_id, model=state.response_model(body.model), choices=choices, usage=job.usage()
    )


async def prepare_chat(
    state: ServerState, body: ChatCompletionRequest, key: str, request_id: str
) -> tuple[PreparedRequest, ToolPlan]:
    """The conversation as an engine request, validated (APIError 400 for anything wrong), and what to
    do with its reply (its tools, its reasoning); its size is checked before it is templated."""
    lora = state.check_model(body.model)
    state.check_accepting()
    _refuse_unsupported(body)
    check_n(state, body.n)
    check_logit_bias(state, body.logit_bias)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true.", "invalid_request", "top_logprobs")
    plan = plan_tools(body, state.tool_parser)
    constraint = output_constraint(body, body.response_format, plan.schema, state.config.grammar_limits)
    messages = [template_message(m) for m in body.messages]
    template_kwargs = _template_kwargs(state, body)
    check_messages_size(state, messages, plan.template_tools, template_kwargs)
    ids = await chat_token_ids(state, messages, body.add_generation_prompt, plan.template_tools, template_kwargs)
    if (parser := state.reasoning_parser) is not None:
        # Whether the reply begins inside reasoning may hang on the prompt's end (an open <think>).
        tail = str(state.engine.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:])) if state.engine.tokenizer else ""
        plan = dataclasses.replace(plan, reasoning=parser.for_reply(tail, constraint is not None))
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    try:
        params = sampling_params(body, requested, top, None, state.sampling_defaults, constraint)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request") from exc
    priority, salt = state.priority(key, body.priority), state.cache_salt(key, body.cache_salt)
    prepared = await prepare(state, request_id, None, ids, params, priority, salt, state.default_max_tokens, lora)
    return prepared, plan


def _template_kwargs(state: ServerState, body: ChatCompletionRequest) -> dict[str, Any]:
    """The template's extra variables: the server's (--chat-template-kwargs), then the request's."""
    try:
        return {**(state.config.chat_template_kwargs or {}), **check_template_kwargs(body.chat_template_kwargs)}
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request", "chat_template_kwargs") from exc


_REFUSED = {
    "audio": "audio output is not supported: this server's models write text only.",
    "prediction": "predicted outputs are not supported.",
    "web_search_options": "web search is not supported.",
    "functions": "functions (deprecated by OpenAI) is not supported: give tools instead.",
    "function_call": "function_call (deprecated by OpenAI) is not supported: give tool_choice instead.",
}


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    """400, naming the field, for what OpenAI's API offers and this server cannot do: better than an
    answer that silently lacks it."""
    for field, why in _REFUSED.items():
        if getattr(body, field) is not None:
            raise APIError(400, why, "unsupported_parameter", field)
    if body.modalities is not None and body.modalities != ["text"]:
        raise APIError(400, 'modalities other than ["text"] are not supported.', "unsupported_parameter", "modalities")
    for i, message in enumerate(body.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if isinstance(part, MediaPart):
                raise APIError(
                    400,
                    f"{part.type} content parts are not supported: this server's models read text only.",
                    "unsupported_content",
                    f"messages.{i}.content.{j}",
                )


def _logprobs(state: ServerState, token_ids: list[int], entries: list[TokenLogprobs], top: int | None) -> ChatLogprobs:
    tok = state.engine.tokenizer
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = decoded(tok, token_id, entry)
        sampled = entry.get(token_id)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        content.append(
            TokenLogprobEntry(
                token=text,
                logprob=finite(sampled.logprob) if sampled else -9999.0,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=(t_text := decoded(tok, t, entry)),
                        logprob=finite(lp.logprob),
                        bytes=list(t_text.encode()),
                    )
                    for t, lp in ranked[: top or 0]
                ],
            )
        )
    return ChatLogprobs(content=content)


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    job: Job,
    request_id: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = now()
    top = (body.top_logprobs or 0) if body.logprobs else None

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        data: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.response_model(body.model),
            "choices": choices,
        }
        if usage is not None:
            data["usage"] = usage
        return sse(data)

    # The role comes first, once per choice, as OpenAI sends it (content null when it will be tool calls).
    first = {"role": "assistant", "content": None if plan.constrained else ""}
    yield chunk([{"index": i, "delta": first, "logprobs": None, "finish_reason": None} for i in range(body.n)])
    sent_tokens = [0] * body.n
    replies = [ReplyStream(plan) for _ in range(body.n)]
    done: set[int] = set()  # every output of a request repeats its finished choices: they were sent
    async for _, output in run_job(state, job):
        for out in output.outputs:
            start = sent_tokens[out.index]
            if out.index in done or (len(out.token_ids) == start and not out.delta_text and not out.finished):
                continue
            logprobs = None
            if top is not None:
                logprobs = _logprobs(state, out.token_ids[start:], (out.logprobs or [])[start:], top).model_dump()
            sent_tokens[out.index] = len(out.token_ids)
            reply = replies[out.index]
            delta = reply.advance(out.delta_text)
            if out.finished:
                delta = delta.then(reply.close(out.finish_reason))
                done.add(out.index)
            for piece in _deltas(plan, delta, out.finished, logprobs):
                yield chunk([{"index": out.index, **piece}])
    if include_usage:
        yield chunk([], job.usage().model_dump())


def _deltas(plan: ToolPlan, delta: ReplyDelta, finished: bool, logprobs: Any) -> list[dict[str, Any]]:
    """A choice's chunks for a new piece of its output: its reasoning first, on its own, then its content
    and tool calls (a choice's last chunk also carries its finish_reason). None for a piece held back (a
    tool call may have begun) that neither ends the choice nor carries logprobs."""
    deltas: list[dict[str, Any]] = [{"reasoning_content": delta.reasoning}] if delta.reasoning else []
    answer: dict[str, Any] = {}
    if delta.content or (plan.mode == "none" and not delta.reasoning):
        answer["content"] = delta.content
    if delta.tool_calls:
        answer["tool_calls"] = delta.tool_calls
    if answer or finished or (not deltas and logprobs is not None):
        deltas.append(answer)
    chunks: list[dict[str, Any]] = [{"delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if chunks:
        chunks[0]["logprobs"] = logprobs
        chunks[-1]["finish_reason"] = delta.finish_reason if finished else None
    return chunks
