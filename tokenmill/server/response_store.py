"""Stored responses (POST /v1/responses with store: true), in memory, bounded: past `capacity` responses,
or past `max_chars` characters of text held, the least recently used are forgotten. Each belongs to the
API key that made it; to any other key it does not exist (404, the same answer as for an id never made,
so ids cannot be probed across keys)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.server.errors import APIError
from tokenmill.server.responses_protocol import FunctionCallItem, Item, MessageItem, OutputFunctionCall, ResponseObject

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

    def num_chars(self) -> int:
        """The text it holds, its whole conversation counted: what an earlier response shares with it
        stays in memory as long as it does."""
        count = sum(_item_chars(item) for item in self.items)
        for out in self.response.output:
            if isinstance(out, OutputFunctionCall):
                count += len(out.arguments)
            else:
                count += sum(len(part.text) for part in out.content)
        return count


def _item_chars(item: Item) -> int:
    if isinstance(item, MessageItem):
        return len(item.text())
    if isinstance(item, FunctionCallItem):
        return len(item.name) + len(item.arguments)
    return len(item.text())


class ResponseStore:
    def __init__(self, capacity: int, max_chars: int) -> None:
        if capacity < 0 or max_chars < 0:
            raise ValueError(f"the response store's bounds must not be negative, got {capacity} and {max_chars}.")
        self.capacity, self.max_chars = capacity, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars: dict[str, int] = {}
        self.num_chars = 0

    def put(self, entry: StoredResponse) -> None:
        """Store `entry` (again, after its response changed: its size is counted anew), then forget the
        least recently used past the bounds (it too, if it alone is larger than they allow)."""
        response_id = entry.response.id
        self._forget(response_id)
        self._entries[response_id] = entry
        self._chars[response_id] = size = entry.num_chars()
        self.num_chars += size
        while self._entries and (len(self._entries) > self.capacity or self.num_chars > self.max_chars):
            self._forget(next(iter(self._entries)))

    def update(self, entry: StoredResponse) -> None:
        """Count a stored entry's new response (its output, once finished); a forgotten one stays so."""
        if self._entries.get(entry.response.id) is entry:
            self.put(entry)

    def get(self, key: str, response_id: str, param: str | None = None) -> StoredResponse:
        """The key's response `response_id`; 404 if it has none by that id."""
        entry = self._entries.get(response_id)
        if entry is None or entry.key != key:
            raise APIError(404, f"no response with id {response_id!r} is stored.", "response_not_found", param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, key: str, response_id: str) -> StoredResponse:
        entry = self.get(key, response_id)
        self._forget(response_id)
        return entry

    def _forget(self, response_id: str) -> None:
        if self._entries.pop(response_id, None) is not None:
            self.num_chars -= self._chars.pop(response_id)

    def __len__(self) -> int:
        return len(self._entries)
