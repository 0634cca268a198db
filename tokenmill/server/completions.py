"""POST /v1/completions: text or token-id prompts (or a batch of them), streamed or not. A request goes
parse (its prompts) -> prepare (the engine's shared preparation, prepare.py) -> admit -> stream or finish."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.engine.input_processor import PreparedRequest
from tokenmill.outputs import CompletionOutput, TokenLogprobs
from tokenmill.server.admission import admit
from tokenmill.server.config import ServerState
from tokenmill.server.constraints import output_constraint
from tokenmill.server.errors import APIError
from tokenmill.server.job import Job, run_job
from tokenmill.server.limits import check_logit_bias, check_n, check_prompt_logprobs
from tokenmill.server.prepare import prepare
from tokenmill.server.prompts import check_prompt_size, tokenize
from tokenmill.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    new_id,
    now,
)
from tokenmill.server.sampling import sampling_params
from tokenmill.server.streaming import JobStreamingResponse, finish, sse
from tokenmill.server.token_text import decoded, finite

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], int):
        return [p]
    return list(p)  # type: ignore[arg-type]


async def create_completion(state: ServerState, body: CompletionRequest, request: Request, key: str) -> Any:
    arrival = time.monotonic()
    request_id = new_id("cmpl")
    with state.limiter.charging_refusals(key):
        prepared = await prepare_completion(state, body, key, request_id)
        job = admit(state, key, prepared, arrival, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return JobStreamingResponse(state, job, _stream(state, body, job, request_id, include_usage))
    await finish(state, job, request)
    response = completion_response(state, body, prepared, job, request_id)
    return JSONResponse(response.model_dump(), headers=job.admission.headers)


def completion_response(
    state: ServerState, body: CompletionRequest, prepared: list[PreparedRequest], job: Job, request_id: str
) -> CompletionResponse:
    """The unstreamed reply of a finished job (also what the Batch API writes for a completions line)."""
    choices = []
    for i, prepared_req in enumerate(prepared):
        for out in job.outputs[i].outputs:
            choices.append(
                _choice(
                    state,
                    body,
                    i * body.n + out.index,
                    prepared_req.prompt_token_ids,
                    job.outputs[i].prompt_logprobs,
                    out,
                    prepared_req.prompt,
                )
            )
    return CompletionResponse(id=request_id, model=state.response_model(body.model), choices=choices, usage=job.usage())


async def prepare_completion(
    state: ServerState, body: CompletionRequest, key: str, request_id: str
) -> list[PreparedRequest]:
    """The request's prompts as engine requests, validated (APIError 400 for anything wrong); every
    prompt's length is checked before any is tokenized."""
    lora = state.check_model(body.model)
    state.check_accepting()
    if body.suffix:
        raise APIError(400, "suffix is not supported.", "unsupported_parameter", "suffix")
    prompts = _prompts(body)
    check_n(state, body.n, len(prompts))
    check_logit_bias(state, body.logit_bias)
    for prompt in prompts:
        check_prompt_size(state, prompt)
    constraint = output_constraint(body, limits=state.config.grammar_limits)
    prompt_lps = body.logprobs if body.echo and body.logprobs is not None else None
    try:
        params = sampling_params(body, body.max_tokens, body.logprobs, prompt_lps, state.sampling_defaults, constraint)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request") from exc
    priority, salt = state.priority(key, body.priority), state.cache_salt(key, body.cache_salt)
    default_max_tokens = state.default_max_tokens or DEFAULT_MAX_TOKENS
    prepared = []
    for i, prompt in enumerate(prompts):
        text, ids = await tokenize(state, prompt)
        prepared.append(
            await prepare(state, f"{request_id}-{i}", text, ids, params, priority, salt, default_max_tokens, lora)
        )
    check_prompt_logprobs(state, prepared)
    return prepared


def _echo_text(state: ServerState, prompt_text: str | None, prompt_ids: list[int]) -> str:
    if prompt_text is not None:
        return prompt_text
    tokenizer = state.engine.tokenizer
    return str(tokenizer.decode(prompt_ids)) if tokenizer is not None else ""


def _choice(
    state: ServerState,
    body: CompletionRequest,
    index: int,
    prompt_ids: list[int],
    prompt_lps: list[TokenLogprobs | None] | None,
    out: CompletionOutput,
    prompt_text: str | None,
) -> CompletionChoice:
    text = (_echo_text(state, prompt_text, prompt_ids) if body.echo else "") + out.text
    logprobs = None
    if body.logprobs is not None:
        ids = (prompt_ids if body.echo else []) + out.token_ids
        entries: list[TokenLogprobs | None] = (prompt_lps or [None] * len(prompt_ids)) if body.echo else []
        logprobs = _logprobs(state, ids, entries + list(out.logprobs or []), 0)
    return CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason
    )


def _logprobs(
    state: ServerState, token_ids: list[int], entries: list[TokenLogprobs | None], offset: int
) -> CompletionLogprobs:
    tok = state.engine.tokenizer
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        text = decoded(tok, token_id, entry)
        result.tokens.append(text)
        sampled = (entry or {}).get(token_id)
        result.token_logprobs.append(finite(sampled.logprob) if sampled else None)
        result.top_logprobs.append(
            {decoded(tok, t, entry): finite(lp.logprob) for t, lp in entry.items()} if entry else None
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result


async def _stream(
    state: ServerState, body: CompletionRequest, job: Job, request_id: str, include_usage: bool
) -> AsyncIterator[str]:
    created, n = now(), body.n
    sent_tokens: dict[int, int] = {}  # choice index -> tokens already sent
    offsets: dict[int, int] = {}
    async for i, output in run_job(state, job):
        prepared = job.prepared[i]
        for out in output.outputs:
            index = i * n + out.index
            first = index not in sent_tokens
            start = sent_tokens.get(index, 0)
            if not first and len(out.token_ids) == start and not out.delta_text and not out.finished:
                continue
            text = out.delta_text
            logprobs = None
            if first and body.echo:
                text = _echo_text(state, prepared.prompt, prepared.prompt_token_ids) + text
            if body.logprobs is not None:
                ids = out.token_ids[start:]
                entries: list[TokenLogprobs | None] = list((out.logprobs or [])[start:])
                if first and body.echo:
                    lps = output.prompt_logprobs or [None] * len(prepared.prompt_token_ids)
                    ids, entries = prepared.prompt_token_ids + ids, list(lps) + entries
                logprobs = _logprobs(state, ids, entries, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
            sent_tokens[index] = len(out.token_ids)
            choice = CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason
            )
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": state.response_model(body.model),
                    "choices": [choice.model_dump()],
                }
            )
    if include_usage:
        yield sse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": state.response_model(body.model),
                "choices": [],
                "usage": job.usage().model_dump(),
            }
        )
