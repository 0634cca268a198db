"""Admission: a prepared request enters the engine's queue only while the queue, the key's rate limits
and the KV cache have room (429, 503 with Retry-After otherwise; 400 for one that could never fit)."""

from __future__ import annotations

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.input_processor import PreparedRequest
from tokenmill.server.config import ServerState
from tokenmill.server.errors import APIError
from tokenmill.server.job import Job, close
from tokenmill.server.protocol import _SamplingFields


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
