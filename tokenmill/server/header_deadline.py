"""A deadline on reading each request's headers (against slow-loris clients that trickle them in).

uvicorn's `timeout_keep_alive` only bounds the silence between requests: the first byte of a request
cancels it, and a fresh connection has none at all, so a client that sends a header byte now and then
holds its socket (and a slot of --limit-concurrency) forever. This protocol starts a clock when a
connection opens and when the first byte of a later request on it arrives, and stops it once that
request's headers are complete (the body has its own deadline: read_deadline.py). When the clock runs
out the connection is closed, after a bare 408 if part of a request had come. Between requests it is
idle, and the keep-alive timer alone decides, as before.

It wraps httptools' protocol, the one uvicorn's "auto" picks when httptools is installed (a dependency
of tokenmill), and is passed to uvicorn as the class itself so that nothing else is picked."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Written by hand: no ASGI app runs for a request whose headers never came.
_RESPONSE_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s: ClassVar[float]  # set per server by `header_deadline_protocol`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True  # the next byte belongs to a request whose headers are not in yet
        self._partial_request = False  # some of that request has come

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is held to the deadline too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers:
            self._partial_request = True
            self._arm()  # also for bytes that begin no message (stray CRLFs), which the parser skips
        super().data_received(data)

    def on_message_begin(self) -> None:
        self._awaiting_headers = self._partial_request = True
        self._arm()  # also for a request that comes in the same read as the end of the one before
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._awaiting_headers = self._partial_request = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_headers = True  # bytes after this begin the next request

    def _arm(self) -> None:
        if self._header_timer is None:  # the clock runs from the request's first byte, not its latest
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A slow request pipelined behind one still being answered: let that answer finish, then close.
            self.cycle.keep_alive = False
            return
        if self._partial_request:
            self.transport.write(_RESPONSE_408)
        self.transport.close()


def header_deadline_protocol(timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class to give uvicorn.Config(http=...): uvicorn builds it with fixed arguments, so the
    deadline travels on the class."""

    class Protocol(HeaderDeadlineProtocol):
        header_timeout_s = timeout_s

    return Protocol
