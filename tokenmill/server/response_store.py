"""Stored responses (POST /v1/responses with store: true), in memory, bounded: past `capacity` the least
recently used is forgotten. Each belongs to the API key that made it; to any other key it does not
exist (404, the same answer as for an id never made, so ids cannot be probed across keys)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.server.errors import APIError
from tokenmill.server.responses_protocol import Item, ResponseObject

IN_FLIGHT = ("queued", "in_progress")


@dataclass
class StoredResponse:
    key: str
    response: ResponseObject
    # The conversation before the output: the previous responses' items, then this request's input (not
    # its instructions, which OpenAI does not carry over). Chains share the item objects, not copies.
    items: list[Item]
    abort: Callable[[], None] | None = None  # while in flight: stops its generation
    cancelled: bool = False

    @property
    def in_flight(self) -> bool:
        return self.response.status in IN_FLIGHT


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the response store's size must not be negative, got {capacity}.")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, key: str, response_id: str, param: str | None = None) -> StoredResponse:
        """The key's response `response_id`; 404 if it has none by that id."""
        entry = self._entries.get(response_id)
        if entry is None or entry.key != key:
            raise APIError(404, f"no response with id {response_id!r} is stored.", "response_not_found", param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, key: str, response_id: str) -> StoredResponse:
        entry = self.get(key, response_id)
        del self._entries[response_id]
        return entry

    def __len__(self) -> int:
        return len(self._entries)
