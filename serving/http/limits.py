"""HTTP/1.1 with limits: uvicorn's httptools protocol, guarded against clients that hold
resources without finishing their requests (``pxrt serve`` runs uvicorn with it).

uvicorn bounds none of these: a request's header size, how long a client may take to
send its headers or its body, and how many sockets it holds open (its concurrency limit
answers 503 but keeps accepting sockets until the process runs out of file
descriptors). ``guarded_protocol(limits)`` (``serving.options.HttpLimits``) returns a protocol class
for ``uvicorn.Config(http=...)`` that:

- answers a new connection at once with ``503`` + ``Retry-After`` + ``Connection: close``
  when ``max_connections`` are open, and logs those refusals at most once per 10 s with
  their count (``serving.logs.RefusalLog``); a refused connection (this, 408, 431) is closed
  without a reset: FIN after the answer, what the client still sends dropped for up to
  ``LINGER_S`` (an RST would lose the answer), for at most ``linger_allowance``
  connections beyond the cap at once;
- answers 431 and closes when a request's URL and headers exceed ``max_header_bytes``;
- answers 400 and closes a request that asks to upgrade the connection (``Connection:
  Upgrade``: a WebSocket, h2c): pxrt serves none, and uvicorn would hand the socket to
  a protocol this guard does not watch (``pxrt serve`` also runs uvicorn with
  ``ws="none"``);
- answers 408 and closes when headers are not complete ``header_timeout_s`` after the
  connection opened or the request began (so a socket that never sends anything is
  closed too), or when a body makes no progress for ``body_timeout_s`` or is not
  complete ``request_timeout_s`` after the request began (checked by one sweep per
  server, every quarter second: no timer per request);
- drains: from ``shutdown`` (uvicorn's graceful shutdown, after it stopped listening) a
  connection's next response carries ``Connection: close`` (the app answers 503 while
  the server drains), so a request that arrives on a kept-alive connection gets an answer
  instead of a reset; a connection idle for ``DRAIN_IDLE_S`` is closed then, as a
  refused one is (FIN, what the client still sends dropped): a client whose request
  crossed the close reads the end of the connection, never a reset;
- tells the app when a client hangs up before its response is complete, through the
  ASGI scope extension ``serving.http.app.DISCONNECT_EXTENSION`` (no task per request).

It subclasses uvicorn's ``HttpToolsProtocol`` and uses its internals (``connections``,
``cycle``, ``scope``, ``transport``, the parser callbacks), so the uvicorn version is
bounded in ``pyproject.toml`` and ``tests/test_limits.py`` checks that those internals
are still there.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import weakref
from typing import Any

import orjson
import uvicorn

from ..accept import Acceptor, linger_allowance
from ..logs import RefusalLog, Throttled
from ..options import HttpLimits
from .app import DISCONNECT_EXTENSION, AppState
from .native import NativeInferProtocol

log = logging.getLogger("pxrt.http")


_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


SWEEP_S = 0.25  # how often deadlines are checked: one timer per server, none per request
DRAIN_IDLE_S = 1.0  # draining: a connection with no request for this long is closed
LINGER_S = 2.0  # a refused connection: how long what its client still sends is dropped


def canned(status: int, message: str, *extra: bytes) -> bytes:
    """A whole HTTP/1.1 response that closes its connection: a JSON error body."""
    body = orjson.dumps({"error": message})
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (
        status,
        _REASONS[status],
        len(body),
    )
    return head + b"".join(extra) + b"connection: close\r\n\r\n" + body


# One sweep per server: uvicorn's state of that server (which all its connections
# share) -> (the loop, the sweep's next timer).
_SWEEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# What uvicorn logs, once per connection, for a request its parser refuses (then 400).
_INVALID = "Invalid HTTP request received."


def _malformed_log() -> Throttled:
    return Throttled(
        "pxrt: answered {count} malformed HTTP request(s) 400 in the last {interval:.0f} s "
        "(the last from {0})"
    )


class _ConnectionLogger:
    """uvicorn's logger for one connection, but its line per malformed request goes to
    the protocol class's ``malformed`` (``serving.logs.Throttled``): a client sending
    garbage on connection after connection writes a line per interval, with the count,
    not a line each (736 in 3 minutes, once). The rest goes to uvicorn's logger."""

    __slots__ = ("_logger", "_proto")

    def __init__(self, logger: logging.Logger, proto: GuardedHttpToolsProtocol) -> None:
        self._logger = logger
        self._proto = proto

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if msg == _INVALID and not args:
            proto = self._proto
            client = proto.client
            peer = f"{client[0]}:{client[1]}" if client else "an unknown peer"
            proto.malformed.event(proto.loop.time(), peer)
            return
        self._logger.warning(msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


class GuardedHttpToolsProtocol(NativeInferProtocol):
    limits = HttpLimits()
    pxrt_server: Any = None  # the serving.Server whose drain (when given) closes connections
    refusals = RefusalLog()  # per protocol class (guarded_protocol makes one per server)
    malformed = _malformed_log()  # (likewise)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        too_many = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        self.logger = _ConnectionLogger(self.logger, self)  # type: ignore[assignment]
        self._header_bytes = 0
        self._refused = False
        self._in_body = False  # headers complete, body not yet
        self._due = 0.0  # when what is being received is due (0: nothing is)
        self._request_due = 0.0  # when the whole request is due
        self._on_lost: list = []
        self._draining = False
        self._idle_since = 0.0  # draining: when it was first seen with no request (0: busy)
        self._linger_until = 0.0  # refused: closed by then if the client has not closed
        if too_many:
            self._refused = True
            self.refusals.refused(self.loop.time(), len(self.connections) - 1)
            transport.write(_FULL)
            self._linger()
            return
        # Headers are due this long after the connection opens: a socket that never
        # sends anything is closed too.
        self._due = self.loop.time() + self.limits.header_timeout_s
        if not self._sweep_running():
            self._sweep()

    def connection_lost(self, exc: Exception | None) -> None:
        self._due = self._request_due = 0.0
        if self._on_lost and self.cycle is not None and not self.cycle.response_complete:
            for callback in self._on_lost:
                callback()
        self._on_lost = []
        super().connection_lost(exc)

    # --------------------------------------------------------------- limits

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown (listening has stopped): drain this connection
        instead of closing it where it stands (see the module's docstring)."""
        self._draining = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # its response says Connection: close
        if not self._sweep_running():
            self._sweep()

    def _sweep_running(self) -> bool:
        entry = _SWEEPS.get(self.server_state)
        return entry is not None and entry[0] is self.loop and not self.loop.is_closed()

    def _sweep(self) -> None:
        # Every SWEEP_S: time out the connections whose headers, body or request are
        # overdue, and close draining ones idle for DRAIN_IDLE_S. Stops when no
        # connection is left.
        now = self.loop.time()
        for conn in list(self.connections):
            if not isinstance(conn, GuardedHttpToolsProtocol):
                continue
            if conn._refused:
                if conn._linger_until and now > conn._linger_until:
                    conn.transport.abort()  # (close() would wait on a client not reading)
                continue
            if conn._draining:
                busy = conn._in_body or (
                    conn.cycle is not None and not conn.cycle.response_complete
                )
                if busy:
                    conn._idle_since = 0.0
                elif not conn._idle_since:
                    conn._idle_since = now
                elif now - conn._idle_since >= DRAIN_IDLE_S:
                    conn.close_answered()  # (without a reset: see _linger)
                    continue
            if conn._due and now > conn._due:
                what = "its body" if conn._in_body else "its headers"
                conn._refuse(408, f"the client took too long to send {what}")
            elif conn._request_due and now > conn._request_due:
                conn._refuse(408, "the client took too long to send its request")
        if self.connections:
            timer = self.loop.call_later(SWEEP_S, self._sweep)
            _SWEEPS[self.server_state] = (self.loop, timer)
        else:
            _SWEEPS.pop(self.server_state, None)

    def _refuse(self, status: int, message: str) -> None:
        self._due = self._request_due = 0.0
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self.transport.write(canned(status, message))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() says http.disconnect
            self.cycle.message_event.set()
        self._linger()

    def can_reply(self) -> bool:
        return not self._refused and super().can_reply()

    def _unsupported_upgrade_warning(self) -> None:
        pass  # (uvicorn's, after the parser stops at an upgrade: answered 400 above)

    def close_answered(self) -> None:
        self._refused = True  # what else the client sends is dropped
        self._linger()

    def _linger(self) -> None:
        """Close a refused connection without a reset: closing a socket whose client
        sent bytes not yet read makes the kernel answer RST, and the client loses the
        answer just written. So: the answer, then FIN (write_eof), and what the client
        still sends is read and dropped until it closes or ``LINGER_S`` pass (the sweep
        closes it then). At most ``linger_allowance`` connections beyond the cap linger
        (the file descriptors stay bounded under a flood); past that, or over TLS (no
        half-close), it closes at once."""
        transport = self.transport
        cap = self.limits.max_connections
        if len(self.connections) > cap + linger_allowance(cap) or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._linger_until = self.loop.time() + LINGER_S
        if not self._sweep_running():
            self._sweep()

    # --------------------------------------------------------------- parser callbacks

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered and lingering: what else comes is dropped
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
        # uvicorn's on_header, inline (one Python call per header, not two).
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def _check_header_size(self) -> None:
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(
                431,
                f"the request's URL and headers are over {self.limits.max_header_bytes} bytes",
            )

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        if self.parser.should_upgrade():
            self._refuse(400, "this server upgrades no connection (no WebSocket, no h2c)")
            return
        self._in_body = True
        self._due = self.loop.time() + self.limits.body_timeout_s
        super().on_headers_complete()
        if self.cycle is not None and (
            self._draining or (self.pxrt_server and self.pxrt_server.draining)
        ):
            self.cycle.keep_alive = False  # answered (503: draining), then closed

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._due = self._request_due = 0.0  # received: the app's time is not the client's
        if not self._refused:
            super().on_message_complete()


_FULL = canned(503, "the server has too many connections open; retry later", b"retry-after: 1\r\n")


def guarded_protocol(
    limits: HttpLimits, server: Any = None, native: AppState | None = None
) -> type[GuardedHttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` that enforces ``limits``; with
    ``server`` (a ``serving.Server``), requests that arrive once it drains are answered
    with ``Connection: close`` even before uvicorn's shutdown begins. With ``native``
    (the app's state, ``app.state.pxrt``), inference and health take the native path
    (``serving.http.native``)."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "limits": limits,
            "pxrt_server": server,
            "refusals": RefusalLog(),
            "malformed": _malformed_log(),
            "native_state": native,
        },
    )


class GuardedServer(uvicorn.Server):
    """uvicorn's server for a ``guarded_protocol`` config, accepting from ``sock`` (a
    listening socket; ``shared``: the workers of ``--workers N`` share it) through an
    ``Acceptor``: connections count against ``max_connections`` from their accept
    (beyond it, a few more to be answered 503, then closed at once) and a TLS handshake
    must finish within ``header_timeout_s`` (``serving.accept``)."""

    def __init__(self, config: uvicorn.Config, sock: socket.socket, shared: bool = False):
        super().__init__(config)
        self.sock = sock
        self.shared = shared
        self.acceptor: Acceptor | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=[])  # (uvicorn listens on nothing: the Acceptor does)
        config, state = self.config, self.server_state
        protocol_class = config.http_protocol_class
        limits: HttpLimits = protocol_class.limits  # type: ignore[attr-defined]
        cap = limits.max_connections

        def protocol() -> Any:
            return protocol_class(  # type: ignore[call-arg]
                config=config, server_state=state, app_state=self.lifespan.state
            )

        self.acceptor = Acceptor(
            self.sock,
            protocol,
            config.ssl,
            handshake_timeout_s=limits.header_timeout_s,
            room=lambda: cap + linger_allowance(cap) - len(state.connections),
            burst=1 if self.shared else 64,
        )

    async def shutdown(self, sockets: Any = None) -> None:
        if self.acceptor is not None:
            if not self.shared:
                # Connections the kernel took that were not accepted yet would be reset
                # with the socket: taken now, their requests are answered (503,
                # draining); from the close on, new ones are refused.
                self.acceptor.take_backlog()
            self.acceptor.close()
            if not self.shared:
                self.sock.close()
        await super().shutdown(sockets)


# The internals of uvicorn's protocol this module reads or overrides (checked by a test).
UVICORN_INTERNALS = (
    "logger",
    "connections",
    "cycle",
    "scope",
    "transport",
    "loop",
    "on_message_begin",
    "on_url",
    "on_header",
    "headers",
    "expect_100_continue",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "data_received",
    "connection_made",
    "connection_lost",
    "shutdown",
    # and the native path's (serving.http.native)
    "parser",
    "url",
    "client",
    "server_state",
    "access_log",
    "access_logger",
    "on_response_complete",
    "_unsupported_upgrade_warning",
)

__all__ = [
    "UVICORN_INTERNALS",
    "GuardedHttpToolsProtocol",
    "GuardedServer",
    "canned",
    "guarded_protocol",
    "linger_allowance",
]
