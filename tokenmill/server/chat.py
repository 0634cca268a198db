"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.outputs import TokenLogprobs
from tokenmill.server import serving
from tokenmill.server.chat_template import chat_prompt_token_ids
from tokenmill.server.config import ServerState
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    TokenLogprobEntry,
    TopLogprob,
    new_id,
    now,
)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request, key: str) -> Any:
    arrival = serving.monotonic()
    state.check_model(body.model)
    state.check_accepting()
    serving.check_n(state, body.n)
    serving.check_logit_bias(state, body.logit_bias)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = chat_prompt_token_ids(state.engine.tokenizer, messages, body.add_generation_prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_messages", "messages") from exc
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = serving.resolve_max_tokens(state, requested, len(ids), state.default_max_tokens)
    top = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true.", "invalid_request", "top_logprobs")
    try:
        params = serving.sampling_params(body, max_tokens, top, None, state.sampling_defaults)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request") from exc
    request_id = new_id("chatcmpl")
    priority, salt = state.priority(key, body.priority), state.cache_salt(key, body.cache_salt)
    prepared = serving.prepare(state, request_id, None, ids, params, priority, salt)
    job = serving.admit(state, key, [prepared], arrival, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return serving.JobStreamingResponse(state, job, _stream(state, body, job, request_id, include_usage))
    await serving.finish(state, job, request)
    choices = [
        ChatChoice(
            index=out.index,
            message=AssistantMessage(content=out.text),
            logprobs=_logprobs(state, out.token_ids, out.logprobs or [], top) if top is not None else None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        for out in job.outputs[0].outputs
    ]
    response = ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=job.usage())
    return JSONResponse(response.model_dump(), headers=job.admission.headers)


def _logprobs(state: ServerState, token_ids: list[int], entries: list[TokenLogprobs], top: int | None) -> ChatLogprobs:
    tok = state.engine.tokenizer
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = serving.decoded(tok, token_id, entry)
        sampled = entry.get(token_id)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        content.append(
            TokenLogprobEntry(
                token=text,
                logprob=serving.finite(sampled.logprob) if sampled else -9999.0,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=(t_text := serving.decoded(tok, t, entry)),
                        logprob=serving.finite(lp.logprob),
                        bytes=list(t_text.encode()),
                    )
                    for t, lp in ranked[: top or 0]
                ],
            )
        )
    return ChatLogprobs(content=content)


async def _stream(
    state: ServerState, body: ChatCompletionRequest, job: serving.Job, request_id: str, include_usage: bool
) -> AsyncIterator[str]:
    created = now()
    top = (body.top_logprobs or 0) if body.logprobs else None

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        data: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "choices": choices,
        }
        if usage is not None:
            data["usage"] = usage
        return serving.sse(data)

    # The role comes first, once per choice, as OpenAI sends it.
    yield chunk(
        [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(body.n)
        ]
    )
    sent_tokens = [0] * body.n
    async for _, output in serving.run_job(state, job):
        for out in output.outputs:
            start = sent_tokens[out.index]
            if len(out.token_ids) == start and not out.delta_text and not out.finished:
                continue
            logprobs = None
            if top is not None:
                logprobs = _logprobs(state, out.token_ids[start:], (out.logprobs or [])[start:], top).model_dump()
            sent_tokens[out.index] = len(out.token_ids)
            yield chunk(
                [
                    {
                        "index": out.index,
                        "delta": {"content": out.delta_text},
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason,
                    }
                ]
            )
    if include_usage:
        yield chunk([], job.usage().model_dump())
