"""Accepting connections from a listening socket that worker processes share
(``pxrt serve --workers N``), one at a time.

An asyncio server accepts every pending connection each time its socket is readable
(libuv and asyncio alike loop until the queue is empty), so when clients connect in a
burst (a load balancer, a load generator's 64 keep-alive connections) the first worker
to wake takes them all and the others get none. ``Acceptor`` takes one connection per
readiness of the socket and goes back to its event loop, where the other workers have
been woken by the same readiness: a burst is spread over the workers, and a worker busy
with a request (a large body's parse) accepts nothing while the others do.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pxrt.workers")


class Acceptor:
    """Accepts connections from ``sock`` (listening, shared) on the running loop, each
    handed to a protocol ``factory()`` makes (over TLS with ``ssl``)."""

    def __init__(self, sock: socket.socket, factory: Callable[[], Any], ssl: Any = None) -> None:
        self.sock = sock
        self.factory = factory
        self.ssl = ssl
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Task] = set()
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._ready)
        self.closed = False

    def _ready(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return  # another worker took it
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.error("pxrt: cannot accept a connection: %s", exc)
                return
            raise
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = self.loop.create_task(
            self.loop.connect_accepted_socket(self.factory, conn, ssl=self.ssl)
        )
        self.tasks.add(task)
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("pxrt: a connection failed to start: %s", task.exception())

    def close(self) -> None:
        """Accept no more (connections already accepted go on)."""
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())


__all__ = ["Acceptor"]
