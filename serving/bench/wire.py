"""The HTTP client ``pxrt bench --url`` drives servers with: HTTP/1.1 keep-alive
connections on asyncio protocols, each request's bytes encoded once and written whole,
responses parsed by httptools (the parser uvicorn uses) and their bodies dropped.

A general client (aiohttp) spends ~70-170 us of CPU per request here, as much as a
trivial model costs the server: on a small machine the client, not the server, would
be measured. This one does only what a load generator needs. ``https://`` URLs go
through aiohttp (``AiohttpClient``), which speaks TLS.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any
from urllib.parse import urlsplit

import httptools


class _Connection(asyncio.Protocol):
    """One keep-alive connection: a request at a time."""

    def __init__(self, client: RawClient) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.waiter: asyncio.Future | None = None
        self.sink: Any = None  # called with each piece of the body as it arrives
        self.status = 0
        self.keep = True
        self.lost = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"a bad HTTP response: {exc}"))
            self.transport.close()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink(body)

    def on_message_complete(self) -> None:
        self.sink = None
        waiter, self.waiter = self.waiter, None
        if not self.keep:
            self.lost = True
            self.transport.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(self.status)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(ConnectionError("the server closed the connection"))

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class RawClient:
    """Up to ``limit`` keep-alive connections to ``host:port``; ``send`` writes one
    request's bytes on a free connection (opening one if none is free and the limit
    allows, else waiting) and returns the response's status."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host = host
        self.port = port
        self.limit = max(1, limit)
        self.idle: list[_Connection] = []
        self.open = 0
        self.waiting: collections.deque[asyncio.Future] = collections.deque()

    async def _acquire(self) -> _Connection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost:
                return conn
            self.open -= 1
        if self.open < self.limit:
            self.open += 1
            try:
                _, conn = await asyncio.get_running_loop().create_connection(
                    lambda: _Connection(self), self.host, self.port
                )
            except BaseException:
                self.open -= 1
                raise
            return conn
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        return await fut

    def _release(self, conn: _Connection) -> None:
        if conn.lost:
            self.open -= 1
            if self.waiting:  # its place may be taken by a new connection
                fut = self.waiting.popleft()
                task = asyncio.ensure_future(self._acquire())
                task.add_done_callback(lambda t: _hand_over(t, fut))
            return
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        self.idle.append(conn)

    async def send(self, data: bytes, sink: Any = None) -> int:
        """Write ``data`` (a whole request) and wait for the whole response; its body
        goes to ``sink(piece)`` as it arrives (else it is dropped). Returns the status."""
        conn = await self._acquire()
        waiter = asyncio.get_running_loop().create_future()
        conn.waiter = waiter
        conn.sink = sink
        conn.transport.write(data)
        try:
            return await waiter
        finally:
            self._release(conn)

    async def close(self) -> None:
        for conn in self.idle:
            conn.transport.close()
        self.idle.clear()


def _hand_over(task: asyncio.Task, fut: asyncio.Future) -> None:
    if fut.done():
        if not task.cancelled() and task.exception() is None:
            task.result().transport.close()
        return
    if task.cancelled():
        fut.cancel()
    elif task.exception() is not None:
        fut.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        fut.set_result(task.result())


class AiohttpClient:
    """The same ``send`` over aiohttp (for ``https://`` URLs)."""

    def __init__(self, url: str, limit: int) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max(1, limit)),
            timeout=aiohttp.ClientTimeout(total=60),
        )

    async def post(self, url: str, body: bytes, headers: dict) -> int:
        async with self.session.post(url, data=body, headers=headers) as r:
            await r.read()
            return r.status

    async def close(self) -> None:
        await self.session.close()


def request_bytes(url: str, body: bytes, headers: dict[str, str]) -> bytes:
    """A whole POST request to ``url`` as it goes on the wire."""
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    head = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def make_client(url: str, limit: int) -> RawClient | AiohttpClient:
    """The client for ``url``: raw for ``http://``, aiohttp for ``https://``."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return AiohttpClient(url, limit)
    return RawClient(parts.hostname or "127.0.0.1", parts.port or 80, limit)


__all__ = ["AiohttpClient", "RawClient", "make_client", "request_bytes"]
