"""Waiting queues: first come first served, or by priority (lower value first, then arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from tokenmill.scheduling.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        """A preempted request goes back to the front: it arrived before everything still waiting."""
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request))

    def prepend(self, request: Request) -> None:
        self.add(request)  # its (priority, arrival) key already places it

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in sorted(self._heap, key=lambda item: item[:3]))


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; use 'fcfs' or 'priority'.")
