"""HTTP/1.1 with limits: uvicorn's httptools protocol, guarded against clients that hold
resources without finishing their requests.

uvicorn bounds none of these: a request's header size, how long a client may take to
send its headers or its body, and how many sockets it holds open (its concurrency limit
answers 503 but keeps accepting sockets until the process runs out of file
descriptors). ``guarded_protocol(limits)`` returns a protocol class for
``uvicorn.Config(http=...)`` that:

- closes a new connection at once when ``max_connections`` are open;
- answers 431 and closes when a request's URL and headers exceed ``max_header_bytes``;
- answers 408 and closes when headers are not complete ``header_timeout_s`` after the
  connection opened or the request began (so a socket that never sends anything is
  closed too), or when a body makes no progress for ``body_timeout_s`` or is not
  complete ``request_timeout_s`` after the request began.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("pxrt.http")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-server limits on what clients may hold (see the module docstring)."""

    max_connections: int = 1000
    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    request_timeout_s: float = 120.0


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits = Limits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        too_many = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        self._header_bytes = 0
        self._refused = False
        self._in_body = False  # headers complete, body not yet
        self._timer: asyncio.TimerHandle | None = None  # headers' deadline, or body's idle
        self._deadline: asyncio.TimerHandle | None = None  # the whole request's
        if too_many:
            log.warning("pxrt: %d connections open; closing a new one", len(self.connections))
            transport.close()
            return
        # Headers are due this long after the connection opens: a socket that never
        # sends anything is closed too.
        self._timer = self.loop.call_later(self.limits.header_timeout_s, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # --------------------------------------------------------------- limits

    def _disarm(self) -> None:
        for timer in (self._timer, self._deadline):
            if timer is not None:
                timer.cancel()
        self._timer = self._deadline = None

    def _timed_out(self) -> None:
        what = "its body" if self._in_body else "its headers"
        self._refuse(408, f"the client took too long to send {what}")

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        body = orjson.dumps({"error": message})
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body)) + body
        )
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() says http.disconnect
            self.cycle.message_event.set()
        self.transport.close()

    # --------------------------------------------------------------- parser callbacks

    def data_received(self, data: bytes) -> None:
        if self._in_body and self._timer is not None:
            self._timer.cancel()  # progress: the body's idle clock restarts
            self._timer = self.loop.call_later(self.limits.body_timeout_s, self._timed_out)
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._timer is None:  # a later request on a kept-alive connection
            self._timer = self.loop.call_later(self.limits.header_timeout_s, self._timed_out)
        self._deadline = self.loop.call_later(
            self.limits.request_timeout_s,
            self._refuse,
            408,
            "the client took too long to send its request",
        )

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        self._check_header_size()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        self._check_header_size()
        super().on_header(name, value)

    def _check_header_size(self) -> None:
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(
                431,
                f"the request's URL and headers are over {self.limits.max_header_bytes} bytes",
            )

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_body = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.limits.body_timeout_s, self._timed_out)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()  # received in full: the app's time is not the client's
        if not self._refused:
            super().on_message_complete()


def guarded_protocol(limits: Limits) -> type[HttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` that enforces ``limits``."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})


__all__ = ["Limits", "guarded_protocol"]
