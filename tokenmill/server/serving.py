"""What the completions and chat endpoints share: request → validated engine requests, admission
(queue bound, rate limits), running them (merged streams, client disconnects), and SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.input_processor import PreparedRequest
from tokenmill.engine.token_texts import token_texts
from tokenmill.outputs import RequestOutput, TokenLogprobs
from tokenmill.sampling_params import (
    OPENAI_SAMPLING_DEFAULTS,
    SamplingParams,
    StructuredOutputsParams,
    with_defaults,
)
from tokenmill.server.audit import attach_job
from tokenmill.server.config import ServerState
from tokenmill.server.errors import ENGINE_FAILED_MESSAGE, INTERNAL_ERROR_MESSAGE, APIError, sse_error
from tokenmill.server.protocol import SpeculativeDecodingUsage, UsageInfo, _SamplingFields
from tokenmill.server.security import Admission

logger = logging.getLogger(__name__)
T = TypeVar("T")


def sampling_params(
    body: _SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    model_defaults: Mapping[str, float | int],
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for one prompt of the request (ValueError -> 400). A sampling field
    the request leaves out comes from the model's defaults (its generation_config.json), else OpenAI's.
    `structured_outputs` is the request's output constraint (constraints.output_constraint)."""
    explicit = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
    }
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        min_tokens=min(body.min_tokens, max_tokens),
        **with_defaults(explicit, model_defaults, OPENAI_SAMPLING_DEFAULTS),
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured_outputs=structured_outputs,
    )


def resolve_max_tokens(
    state: ServerState, requested: int | None, num_prompt_tokens: int, default: int | None = None
) -> int:
    """The request's max_tokens, checked against the server's cap; when it gives none, `default`
    (or as many as fit), within the cap and the context."""
    if num_prompt_tokens > state.max_prompt_tokens:
        raise APIError(
            400,
            f"the prompt has {num_prompt_tokens} tokens; this server accepts at most {state.max_prompt_tokens}.",
            "prompt_too_long",
            "prompt",
        )
    room = state.engine.max_model_len - num_prompt_tokens
    if requested is None:
        return max(1, min(state.max_tokens, room, default or room))
    if requested > state.max_tokens:
        raise APIError(
            400,
            f"max_tokens is {requested}; this server allows at most {state.max_tokens}.",
            "max_tokens_too_large",
            "max_tokens",
        )
    return requested


def check_n(state: ServerState, n: int, num_prompts: int = 1) -> None:
    if n > state.config.max_n:
        raise APIError(400, f"n is {n}; this server allows at most {state.config.max_n}.", "n_too_large", "n")
    if num_prompts > state.config.max_prompts_per_request:
        raise APIError(
            400,
            f"{num_prompts} prompts in one request; this server allows at most {state.config.max_prompts_per_request}.",
            "too_many_prompts",
            "prompt",
        )


def check_logit_bias(state: ServerState, logit_bias: Mapping[Any, float] | None) -> None:
    cap = state.config.max_logit_bias
    if logit_bias and len(logit_bias) > cap:
        raise APIError(
            400,
            f"logit_bias has {len(logit_bias)} entries; this server allows at most {cap}.",
            "logit_bias_too_large",
            "logit_bias",
        )


def check_prompt_logprobs(state: ServerState, prepared: list[PreparedRequest]) -> None:
    """Echo with logprobs returns up to k + 1 entries per prompt token (the top k and the prompt's own);
    cap their total over the request's prompts. The n samples of a prompt share one computation of its
    prompt logprobs, so n does not multiply it."""
    entries = sum(
        (p.params.prompt_logprobs + 1) * len(p.prompt_token_ids)
        for p in prepared
        if p.params.prompt_logprobs is not None
    )
    cap = state.config.max_prompt_logprobs_entries
    if entries > cap:
        raise APIError(
            400,
            f"echo with logprobs asks for {entries} prompt logprob entries ((logprobs + 1) x prompt tokens, "
            f"summed over the prompts); this server allows at most {cap}. Ask for fewer logprobs, send shorter "
            "or fewer prompts, or leave out echo.",
            "prompt_logprobs_too_large",
            "logprobs",
        )


async def prepare(
    state: ServerState,
    request_id: str,
    prompt_text: str | None,
    prompt_ids: list[int],
    params: SamplingParams,
    priority: int,
    cache_salt: str | None = None,
) -> PreparedRequest:
    """The engine's checks of a tokenized request (400 on failure). A request with an output constraint
    compiles its grammar here (the first one also builds the grammar library's view of the vocabulary):
    that runs on the prompt thread, off the event loop, like tokenization."""
    args = (request_id, prompt_text or prompt_ids, params, priority, prompt_ids, cache_salt)
    try:
        if params.structured_outputs is None:
            return state.engine.prepare(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(state.prompt_pool, lambda: state.engine.prepare(*args))
    except (ValueError, RecursionError) as exc:  # RecursionError: a schema nested beyond reason
        message = str(exc) if isinstance(exc, ValueError) else "the output constraint is nested too deeply."
        raise APIError(400, message, "invalid_request") from exc


@dataclass
class Job:
    """An admitted request: its engine requests (queued at admission), and the budget it reserved."""

    prepared: list[PreparedRequest]
    admission: Admission
    arrival_time: float
    streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # the latest, by prompt index
    closed: bool = False
    deadline: float | None = None  # monotonic: past it, the request is aborted (504)
    queue_deadline: float | None = None  # monotonic: past it with a prompt that has no output yet, the same
    timed_out: str | None = None  # which deadline aborted it
    speculative: bool = False  # the engine speculates: usage reports draft and accepted tokens
    model_name: str | None = None  # the model it runs on (`name@version` when a pool routed it)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.prepared)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for out in self.outputs.values() for o in out.outputs)

    def usage(self) -> UsageInfo:
        prompt, completion = self.num_prompt_tokens, self.num_generated_tokens
        spec = None
        if self.speculative:
            # Counted on finished outputs only (their metrics); summed over prompts and their n samples.
            metrics = [out.metrics for out in self.outputs.values() if out.metrics is not None]
            spec = SpeculativeDecodingUsage(
                num_draft_tokens=sum(m.num_draft_tokens for m in metrics),
                num_accepted_tokens=sum(m.num_accepted_tokens for m in metrics),
            )
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            speculative_decoding=spec,
        )


def admit(
    state: ServerState,
    key: str,
    prepared: list[PreparedRequest],
    arrival_time: float,
    deadlines: _SamplingFields | None = None,
) -> Job:
    """Bound the waiting queue, charge the key's rate limits (429 when either is full), then queue
    the requests in the engine at once, so the next admission sees them. Call `close` when done."""
    new_reqs = sum(len(p.children) for p in prepared)
    new_tokens = sum(len(p.children) * len(p.prompt_token_ids) for p in prepared)
    waiting_reqs, waiting_tokens = state.engine.waiting_load()
    cfg = state.config
    # The bound holds for a request arriving at an empty queue too, else one request with many
    # prompts x n could fill it alone. One that could never fit gets 400, not 429: retrying cannot
    # help it, and OpenAI's clients retry 429s by themselves (as the rate limits' "request too
    # large" is a 400 too).
    for count, bound, what in (
        (new_reqs, cfg.max_waiting_requests, "sequences (prompts x n)"),
        (new_tokens, cfg.max_waiting_tokens, "prompt tokens (x n)"),
    ):
        if count > bound:
            raise APIError(
                400,
                f"this request queues {count} {what}; this server queues at most {bound}. "
                "Send fewer prompts, a smaller n, or split the request.",
                "request_exceeds_queue_limit",
            )
    if waiting_reqs + new_reqs > cfg.max_waiting_requests or waiting_tokens + new_tokens > cfg.max_waiting_tokens:
        raise APIError(
            429,
            f"the server is at capacity ({waiting_reqs} requests waiting); retry shortly.",
            "queue_full",
            headers={"Retry-After": "1"},
        )
    check_memory_pressure(state, waiting_tokens)
    reserved = sum(len(p.children) * (len(p.prompt_token_ids) + (p.params.max_tokens or 0)) for p in prepared)
    job = Job(prepared, state.limiter.acquire(key, reserved), arrival_time)
    job.speculative = state.engine.config.speculative is not None
    job.model_name = state.model_name
    cfg_timeout, cfg_queue = cfg.request_timeout_s, cfg.max_queue_time_s
    timeout = _tighter(cfg_timeout, deadlines.request_timeout if deadlines else None)
    queue_time = _tighter(cfg_queue, deadlines.max_queue_time if deadlines else None)
    job.deadline = None if timeout is None else arrival_time + timeout
    job.queue_deadline = None if queue_time is None else arrival_time + queue_time
    try:
        job.streams = [state.engine.generate(p, arrival_time) for p in prepared]
    except EngineDeadError as exc:
        close(state, job)
        raise APIError(
            503, "the engine has stopped (restarts spent); the server must be restarted.", "engine_dead"
        ) from exc
    return job


def check_memory_pressure(state: ServerState, waiting_tokens: int) -> None:
    """503 with Retry-After while the KV cache is nearly full AND the queue already holds a nearly full
    cache's worth of prompt tokens: a new request would wait for the whole cache to turn over at least
    once, and every admission adds to the pressure that preempts running requests. A balancer (or
    the client) does better sending it elsewhere or later. Below either bound, requests queue."""
    threshold = state.config.memory_pressure_threshold
    if threshold is None:
        return
    engine = state.engine
    capacity = engine.num_blocks * engine.config.cache.block_size  # tokens the KV cache holds
    if engine.snapshot.kv_cache_usage >= threshold and waiting_tokens >= threshold * capacity:
        raise APIError(
            503,
            f"the server is under memory pressure (KV cache {engine.snapshot.kv_cache_usage:.0%} full, "
            f"{waiting_tokens} prompt tokens waiting); retry shortly or on another replica.",
            "memory_pressure",
            headers={"Retry-After": "2"},
        )


def _tighter(server: float | None, requested: float | None) -> float | None:
    """A request's own deadline, clamped to the server's: it may ask for less time, never more."""
    if server is None or requested is None:
        return requested if server is None else server
    return min(server, requested)


def close(state: ServerState, job: Job) -> None:
    """Abort what has not finished (a client gone, an error) and refund the unused token budget."""
    if job.closed:
        return
    job.closed = True
    for p in job.prepared:
        state.engine.abort(p.request_id)  # a no-op for finished requests
    used = sum(len(p.children) * len(p.prompt_token_ids) for p in job.prepared) + job.num_generated_tokens
    state.limiter.refund(job.admission.key, job.admission.num_tokens - used)


async def run_job(state: ServerState, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every prompt's outputs, as (prompt index, output), merged as they come. Closing it aborts
    what has not finished; an engine failure raises APIError(500). Past a deadline the job's requests
    are aborted: their last outputs (finish_reason "abort") come, then APIError(504)."""
    watchdog = asyncio.ensure_future(_watch_deadlines(state, job)) if job.deadline or job.queue_deadline else None
    try:
        async for index, output in _merge(job.streams):
            if output.error is not None:
                logger.error("request %s failed: %s", output.request_id, output.error)
                raise APIError(500, ENGINE_FAILED_MESSAGE, "engine_error")
            job.outputs[index] = output
            yield index, output
    finally:
        if watchdog is not None:
            watchdog.cancel()
    aborted = any(o.finish_reason == "abort" for out in job.outputs.values() for o in out.outputs)
    if job.timed_out is not None and aborted:
        what = "its first output" if job.timed_out == "queue" else "its last token"
        raise APIError(
            504,
            f"the request timed out: it waited too long for {what}; retry, or ask for less.",
            job.timed_out + "_timeout",
        )


async def _watch_deadlines(state: ServerState, job: Job) -> None:
    """Abort the job's requests (as a client disconnect does) once one of its deadlines passes: the
    whole request's, or the queue's while a prompt has had no output (no step has scheduled it)."""
    while True:
        now = monotonic()
        queue_deadline = job.queue_deadline if len(job.outputs) < len(job.prepared) else None
        if job.deadline is not None and now >= job.deadline:
            job.timed_out = "request"
        elif queue_deadline is not None and now >= queue_deadline:
            job.timed_out = "queue"
        else:
            due = [d for d in (job.deadline, queue_deadline) if d is not None]
            if not due:
                return
            await asyncio.sleep(min(due) - now)
            continue
        logger.info("request %s timed out (%s deadline)", job.prepared[0].request_id, job.timed_out)
        for p in job.prepared:
            state.engine.abort(p.request_id)  # its last output ("abort") ends its stream; blocks are freed
        return


async def _merge(its: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    if len(its) == 1:  # the common case, without tasks
        try:
            async for item in its[0]:
                yield 0, item
        except EngineDeadError as exc:
            logger.error("engine failure: %s", exc)
            raise APIError(500, ENGINE_FAILED_MESSAGE, "engine_error") from exc
        finally:
            await its[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(its)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, EngineDeadError):
                logger.error("engine failure: %s", item)
                raise APIError(500, ENGINE_FAILED_MESSAGE, "engine_error") from item
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "the client closed the connection.", "client_closed")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_frames(job: Job, frames: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frames of a stream, then [DONE]; an error mid-stream becomes an error frame first."""
    try:
        async for frame in frames:
            yield frame
    except APIError as exc:
        yield sse_error(exc.status, exc.message, exc.code)
    except Exception:
        logger.exception("a stream failed")
        yield sse_error(500, INTERNAL_ERROR_MESSAGE, "internal_error")
    yield SSE_DONE


class JobStreamingResponse(StreamingResponse):
    """A stream that closes its job however it ends, even when the client left before it began."""

    def __init__(self, state: ServerState, job: Job, frames: AsyncIterator[str]) -> None:
        super().__init__(
            sse_frames(job, frames),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **job.admission.headers},
        )
        self.state, self.job = state, job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        attach_job(scope, self.job)
        try:
            await super().__call__(scope, receive, send)
        finally:
            close(self.state, self.job)


async def finish(state: ServerState, job: Job, request: Request) -> None:
    """Run an unstreamed job to its end; a client that disconnects first aborts it."""
    attach_job(request.scope, job)
    try:
        await until_disconnect(request, _drain(state, job))
    finally:
        close(state, job)


async def _drain(state: ServerState, job: Job) -> None:
    async for _ in run_job(state, job):
        pass


def decoded(tokenizer: Any, token_id: int, entry: TokenLogprobs | None) -> str:
    lp = (entry or {}).get(token_id)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return token_texts(tokenizer)[token_id] if tokenizer is not None else f"token_id:{token_id}"


def finite(logprob: float) -> float:
    """JSON has no -inf or NaN: a logprob that is one becomes a very unlikely finite value."""
    return max(-9999.0, logprob)  # NaN compares false, so it also becomes -9999


def monotonic() -> float:
    return time.monotonic()
