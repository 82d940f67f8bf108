"""HTTP/1.1 with limits: uvicorn's httptools protocol, guarded against clients that hold
resources without finishing their requests (``pxrt serve`` runs uvicorn with it).

uvicorn bounds none of these: a request's header size, how long a client may take to
send its headers or its body, and how many sockets it holds open (its concurrency limit
answers 503 but keeps accepting sockets until the process runs out of file
descriptors). ``guarded_protocol(limits)`` (``serving.options.HttpLimits``) returns a protocol class
for ``uvicorn.Config(http=...)`` that:

- closes a new connection at once when ``max_connections`` are open;
- answers 431 and closes when a request's URL and headers exceed ``max_header_bytes``;
- answers 408 and closes when headers are not complete ``header_timeout_s`` after the
  connection opened or the request began (so a socket that never sends anything is
  closed too), or when a body makes no progress for ``body_timeout_s`` or is not
  complete ``request_timeout_s`` after the request began (checked by one sweep per
  server, every quarter second: no timer per request);
- tells the app when a client hangs up before its response is complete, through the
  ASGI scope extension ``serving.http.DISCONNECT_EXTENSION`` (no task per request).

It subclasses uvicorn's ``HttpToolsProtocol`` and uses its internals (``connections``,
``cycle``, ``scope``, ``transport``, the parser callbacks), so the uvicorn version is
bounded in ``pyproject.toml`` and ``tests/test_limits.py`` checks that those internals
are still there.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .http import DISCONNECT_EXTENSION
from .options import HttpLimits

log = logging.getLogger("pxrt.http")


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


SWEEP_S = 0.25  # how often deadlines are checked: one timer per server, none per request


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits = HttpLimits()
    _sweeping: dict = {}  # loop -> its sweep's timer (one per server's loop)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        too_many = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        self._header_bytes = 0
        self._refused = False
        self._in_body = False  # headers complete, body not yet
        self._due = 0.0  # when what is being received is due (0: nothing is)
        self._request_due = 0.0  # when the whole request is due
        self._on_lost: list = []
        if too_many:
            log.warning("pxrt: %d connections open; closing a new one", len(self.connections))
            transport.close()
            return
        # Headers are due this long after the connection opens: a socket that never
        # sends anything is closed too.
        self._due = self.loop.time() + self.limits.header_timeout_s
        if self.loop not in self._sweeping:
            self._sweep()

    def connection_lost(self, exc: Exception | None) -> None:
        self._due = self._request_due = 0.0
        if self._on_lost and self.cycle is not None and not self.cycle.response_complete:
            for callback in self._on_lost:
                callback()
        self._on_lost = []
        super().connection_lost(exc)

    # --------------------------------------------------------------- limits

    def _sweep(self) -> None:
        # Every SWEEP_S: time out the connections whose headers, body or request are
        # overdue. Stops when no connection is left.
        now = self.loop.time()
        for conn in list(self.connections):
            if not isinstance(conn, GuardedHttpToolsProtocol) or conn._refused:
                continue
            if conn._due and now > conn._due:
                what = "its body" if conn._in_body else "its headers"
                conn._refuse(408, f"the client took too long to send {what}")
            elif conn._request_due and now > conn._request_due:
                conn._refuse(408, "the client took too long to send its request")
        if self.connections:
            self._sweeping[self.loop] = self.loop.call_later(SWEEP_S, self._sweep)
        else:
            self._sweeping.pop(self.loop, None)

    def _refuse(self, status: int, message: str) -> None:
        self._due = self._request_due = 0.0
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
        if self._in_body:
            self._due = self.loop.time() + self.limits.body_timeout_s  # progress
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._on_lost = []
        # ASGI extensions are free-form; uvicorn's scope type says dict values.
        self.scope["extensions"] = {DISCONNECT_EXTENSION: self._on_lost.append}  # type: ignore[dict-item]
        now = self.loop.time()
        if not self._due:  # a later request on a kept-alive connection
            self._due = now + self.limits.header_timeout_s
        self._request_due = now + self.limits.request_timeout_s

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
        self._due = self.loop.time() + self.limits.body_timeout_s
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._due = self._request_due = 0.0  # received: the app's time is not the client's
        if not self._refused:
            super().on_message_complete()


def guarded_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` that enforces ``limits``."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})


# The internals of uvicorn's protocol this module reads or overrides (checked by a test).
UVICORN_INTERNALS = (
    "connections",
    "cycle",
    "scope",
    "transport",
    "loop",
    "on_message_begin",
    "on_url",
    "on_header",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "data_received",
    "connection_made",
    "connection_lost",
)

__all__ = ["UVICORN_INTERNALS", "GuardedHttpToolsProtocol", "guarded_protocol"]
