"""What is wrong with the engine, if anything, said two ways: a public message for /health (anyone may
ask, so it says what, never why: the engine's failure text can hold exception text and file paths) and
the detail, for the log and for surfaces behind a key (the dashboard's data)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.async_engine import AsyncEngine


@dataclass(frozen=True)
class EngineTrouble:
    code: str  # engine_dead, engine_restarting or engine_stalled
    message: str  # public
    detail: str | None  # why, where the engine said


def engine_trouble(engine: AsyncEngine) -> EngineTrouble | None:
    """None while the engine is up; else why /health answers 503."""
    if engine.is_dead:
        return EngineTrouble("engine_dead", "the engine is dead; see the server's log.", engine.dead_reason)
    if engine.restarting is not None:
        return EngineTrouble(
            "engine_restarting", "the engine is restarting after it died; see the server's log.", engine.restarting
        )
    if engine.is_stalled():
        return EngineTrouble("engine_stalled", "the engine step has stalled.", None)
    return None
