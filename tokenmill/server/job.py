"""A job: an admitted request's engine requests, run to their end. Their outputs merged as they come,
its deadlines watched, and `close` aborting what is left and refunding the unused token budget."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.input_processor import PreparedRequest
from tokenmill.outputs import RequestOutput
from tokenmill.server.config import ServerState
from tokenmill.server.errors import ENGINE_FAILED_MESSAGE, APIError
from tokenmill.server.protocol import PromptTokensDetails, SpeculativeDecodingUsage, UsageInfo
from tokenmill.server.security import Admission

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (once per prompt, as num_prompt_tokens counts them)."""
        return sum(out.metrics.num_cached_tokens for out in self.outputs.values() if out.metrics is not None)

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
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
            speculative_decoding=spec,
        )


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
        now = time.monotonic()
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
