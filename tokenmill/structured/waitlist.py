"""Requests waiting for their grammar: the engine's step loop never compiles. A request whose spec is
not compiled yet waits here while a compile thread compiles it, and joins the scheduler at the first
step after; every other request keeps stepping meanwhile."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Generic, TypeVar

from tokenmill.structured.backend import Grammar

T = TypeVar("T")


@dataclass
class Compiled(Generic[T]):
    """The waiting requests whose compile has ended: `ready` may be scheduled, `failed` with why."""

    ready: list[T]
    failed: list[tuple[T, str]]


class GrammarWaitlist(Generic[T]):
    def __init__(self) -> None:
        self._waiting: dict[str, tuple[T, Future[Grammar]]] = {}  # by request id, in arrival order

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req_id: str, item: T, grammar: Future[Grammar]) -> None:
        self._waiting[req_id] = (item, grammar)

    def remove(self, req_id: str) -> None:
        """Forget a request (aborted while its grammar compiled); the compile itself goes on and is cached."""
        self._waiting.pop(req_id, None)

    def take_compiled(self) -> Compiled[T]:
        """Take out the requests whose compile has ended, in arrival order."""
        compiled: Compiled[T] = Compiled([], [])
        for req_id, (item, grammar) in list(self._waiting.items()):
            if not grammar.done():
                continue
            del self._waiting[req_id]
            error = grammar.exception()
            if error is None:
                compiled.ready.append(item)
            elif isinstance(error, ValueError):  # the backend's message for a spec it rejects
                compiled.failed.append((item, str(error)))
            else:  # never let one spec's failure stop the engine
                compiled.failed.append((item, f"the output constraint failed to compile: {error!r}"))
        return compiled

    def wait(self, timeout: float) -> None:
        """Until a compile ends or `timeout` seconds pass: what the step loop does when nothing else runs."""
        wait([grammar for _, grammar in self._waiting.values()], timeout, FIRST_COMPLETED)
