"""One metrics merge: the offline LLM and the async engine (its core in another process, which
sends a request's timings only when they change) report the same RequestMetrics for one request."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from tests.server.conftest import engine_args
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm import LLM
from tokenmill.outputs import RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams

PARAMS = SamplingParams(n=2, max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = list(range(5, 40))  # three blocks of 16: child 1 finds child 0's full blocks cached


def _offline(model: Path) -> RequestOutput:
    args = dataclasses.asdict(engine_args(model))
    return LLM(**args).generate({"prompt_token_ids": PROMPT}, PARAMS, use_tqdm=False)[0]


async def _served(model: Path) -> RequestOutput:
    engine = AsyncEngine(engine_args(model), engine_process=True)
    engine.start()
    try:
        final = None
        async for out in engine.generate(engine.prepare("r", {"prompt_token_ids": PROMPT}, PARAMS)):
            final = out
        assert final is not None
        return final
    finally:
        engine.shutdown()


def _shape(m: RequestMetrics) -> dict[str, object]:
    """What both paths must agree on: which times are known and in what order, and the counts."""
    assert m.first_scheduled_time is not None and m.first_token_time is not None and m.finished_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    return {
        "known": [f.name for f in dataclasses.fields(m) if getattr(m, f.name) is not None],
        "counts": (m.num_preemptions, m.num_cached_tokens, m.num_draft_tokens, m.num_accepted_tokens),
    }


def test_offline_and_served_requests_report_the_same_metrics(chat_model: Path) -> None:
    offline, served = _offline(chat_model), asyncio.run(_served(chat_model))
    assert offline.metrics is not None and served.metrics is not None
    assert [o.token_ids for o in offline.outputs] == [o.token_ids for o in served.outputs]
    assert _shape(offline.metrics) == _shape(served.metrics)
