"""Accepting connections for ``pxrt serve``'s listeners: counted from ``accept``, TLS
handshakes bounded in time, and (for the workers of ``--workers N``, which share a
listening socket) one connection per wake.

asyncio calls a protocol's ``connection_made`` once a TLS handshake is done, so a
listener that counts its connections there does not see sockets still in their
handshake: silent clients could hold every file descriptor the process has (and did,
before this module), each for asyncio's default handshake timeout of 60 s. An
``Acceptor`` counts a TLS connection from the moment it is accepted: one that would put
the listener over its cap (``room``, with those in their handshake) is closed at once,
and a handshake that does not finish within ``handshake_timeout_s`` is given up. (A
plain connection reaches its protocol at once, which counts it and answers one over the
cap with why.) A failed handshake (plain HTTP sent to the
TLS port, a client that does not trust the certificate) is logged, at most once per 10 s
with the count.

Workers: an asyncio server accepts every pending connection each time its socket is
readable (libuv and asyncio alike loop until the queue is empty), so when clients
connect in a burst (a load balancer, a load generator's 64 keep-alive connections) the
first worker to wake takes them all and the others get none. With ``burst=1`` an
``Acceptor`` takes one connection per readiness of the socket and goes back to its
event loop, where the other workers have been woken by the same readiness: a burst is
spread over the workers, and a worker busy with a request (a large body's parse) accepts
nothing while the others do.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import ssl as ssl_module
from collections.abc import Callable
from typing import Any

from .logs import RefusalLog, Throttled

log = logging.getLogger("pxrt.workers")


def linger_allowance(max_connections: int) -> int:
    """Connections a listener takes beyond ``max_connections`` only to refuse them (an
    answer saying why, then a close without a reset): its file descriptors are
    ``max_connections`` plus this."""
    return min(64, max(4, max_connections // 8))


class Acceptor:
    """Accepts connections from ``sock`` (listening) on the running loop, each handed to
    a protocol ``factory()`` makes (over TLS with ``ssl``, whose handshake must finish
    within ``handshake_timeout_s``). ``room()``: how many more connections the listener
    may hold now (its protocols' count); TLS connections in their handshake count
    against it too. ``burst``: connections taken per readiness of the socket."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], Any],
        ssl: Any = None,
        *,
        handshake_timeout_s: float = 10.0,
        room: Callable[[], int] | None = None,
        burst: int = 1,
        kind: str = "HTTP",
    ) -> None:
        self.sock = sock
        self.factory = factory
        self.ssl = ssl
        self.handshake_timeout_s = handshake_timeout_s
        self.room = room
        self.burst = burst
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Task] = set()  # connections accepted, not yet handed over
        self.refusals = RefusalLog(kind=kind)
        self.failures = Throttled(
            "pxrt: {count} " + kind + " connection(s) failed to start in the last "
            "{interval:.0f} s (the last: {0})"
        )
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._ready)
        self.closed = False

    def take_backlog(self) -> None:
        """Accept every connection waiting in the listening socket's backlog (before it
        closes, which would reset them)."""
        burst, self.burst = self.burst, 1 << 30
        try:
            self._ready()
        finally:
            self.burst = burst

    def _ready(self) -> None:
        for _ in range(self.burst):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # none left (another worker took it)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.error("pxrt: cannot accept a connection: %s", exc)
                    return
                raise
            if self.ssl is not None and self.room is not None and self.room() <= len(self.tasks):
                # Over TLS nothing can be answered before a handshake: closed. (A plain
                # connection is handed over at once: its protocol answers why.)
                self.refusals.refused(self.loop.time(), len(self.tasks))
                conn.close()
                continue
            conn.setblocking(False)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            options: dict[str, Any] = {}
            if self.ssl is not None:
                options = {"ssl": self.ssl, "ssl_handshake_timeout": self.handshake_timeout_s}
            task = self.loop.create_task(
                self.loop.connect_accepted_socket(self.factory, conn, **options)
            )
            self.tasks.add(task)
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            if isinstance(exc, (ssl_module.SSLError, TimeoutError, ConnectionError)):
                why = f"{type(exc).__name__}: {exc}"
            else:
                why = repr(exc)
            self.failures.event(self.loop.time(), why[:200])

    def close(self) -> None:
        """Accept no more (connections already accepted go on)."""
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())


def listening_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening TCP socket for an ``Acceptor`` (inheritable: the workers of
    ``--workers N`` all accept from one; a connection goes to whichever is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(backlog)
    sock.set_inheritable(True)
    os.set_blocking(sock.fileno(), False)
    return sock


__all__ = ["Acceptor", "linger_allowance", "listening_socket"]
