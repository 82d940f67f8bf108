"""A lean gRPC client for ``pxrt bench --url grpc://``: unary calls over one HTTP/2
connection, built on pxrt's own HTTP/2 pieces (``serving.grpc.h2``: frames, the HPACK
encoder; ``serving.grpc._hpack``: the decoder).

grpcio's Python client spends ~280 us of CPU per call here, which at one stream is
most of what a trivial model's latency measures. This one writes a call as one
``HEADERS`` + ``DATA`` write (the header block encoded once per method) and reads the
answer's frames straight off the socket: the cost of a load generator, not of a
general client.

What it does not do: TLS, and requests over the peer's initial flow-control window
(64 KiB unless the server says more): ``GrpcTarget`` uses grpcio for those.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from ..grpc.h2 import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    encode_headers,
    frame_head,
    hpack,
)

_HEAD = struct.Struct(">IBI")
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_PREFIX = struct.Struct(">BI")


class GrpcError(Exception):
    """A call answered with a non-zero grpc-status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"gRPC status {status}: {message}")
        self.status = status


class _Call:
    __slots__ = ("future", "body", "status", "message")

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future
        self.body = bytearray()
        self.status = -1
        self.message = ""


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying unary gRPC calls."""

    def __init__(self, authority: str) -> None:
        self.authority = authority.encode()
        self.transport: Any = None
        self.decoder = hpack.Decoder()
        self.buf = bytearray()
        self.calls: dict[int, _Call] = {}
        self.next_id = 1
        self.peer_window = DEFAULT_WINDOW  # what a new stream may send
        self.peer_frame = DEFAULT_FRAME
        self.max_streams = 100
        self.slots: asyncio.Semaphore | None = None
        self.ready: asyncio.Future | None = None
        self.lost: Exception | None = None
        self.header_block = bytearray()  # a HEADERS + CONTINUATION in progress
        self.header_stream = 0
        self.header_end = False
        self._blocks: dict[bytes, bytes] = {}  # path -> its request header block

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.ready = asyncio.get_running_loop().create_future()
        settings = _SETTING.pack(INITIAL_WINDOW_SIZE, MAX_WINDOW) + _SETTING.pack(
            MAX_FRAME_SIZE, 1 << 20
        )
        transport.write(
            PREFACE
            + frame_head(SETTINGS, 0, 0, len(settings))
            + settings
            + frame_head(WINDOW_UPDATE, 0, 0, 4)
            + _U32.pack(MAX_WINDOW - DEFAULT_WINDOW)
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("the server closed the connection")
        for call in self.calls.values():
            if not call.future.done():
                call.future.set_exception(self.lost)
        self.calls.clear()
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(self.lost)

    # ------------------------------------------------------------------ calls

    async def unary(self, path: bytes, message: bytes) -> bytes:
        """One call: the response message's bytes (``GrpcError`` for a non-zero
        status)."""
        if self.lost is not None:
            raise self.lost
        if len(message) + 5 > self.peer_window:
            raise ValueError("request over the peer's flow-control window")
        assert self.slots is not None
        async with self.slots:
            stream_id = self.next_id
            self.next_id += 2
            future = asyncio.get_running_loop().create_future()
            call = self.calls[stream_id] = _Call(future)
            block = self._blocks.get(path)
            if block is None:
                block = self._blocks[path] = encode_headers(
                    [
                        (b":method", b"POST"),
                        (b":scheme", b"http"),
                        (b":path", path),
                        (b":authority", self.authority),
                        (b"content-type", b"application/grpc"),
                        (b"te", b"trailers"),
                    ]  # fmt: skip
                )
            payload = _PREFIX.pack(0, len(message)) + message
            out = [frame_head(HEADERS, END_HEADERS, stream_id, len(block)), block]
            for at in range(0, len(payload), self.peer_frame):
                part = payload[at : at + self.peer_frame]
                last = at + self.peer_frame >= len(payload)
                out += [frame_head(DATA, END_STREAM if last else 0, stream_id, len(part)), part]
            self.transport.writelines(out)
            await future
        if call.status != 0:
            raise GrpcError(call.status, call.message)
        body = call.body
        if len(body) < 5:
            raise GrpcError(13, "an empty response")
        return bytes(body[5:])

    # ------------------------------------------------------------------ frames

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        at = 0
        end = len(buf)
        while end - at >= 9:
            word, flags, stream_id = _HEAD.unpack_from(buf, at)
            length, kind = word >> 8, word & 0xFF
            if end - at - 9 < length:
                break
            payload = bytes(buf[at + 9 : at + 9 + length])
            at += 9 + length
            self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
        del buf[:at]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == DATA:
            if flags & PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            call = self.calls.get(stream_id)
            if call is not None:
                call.body += payload
            if payload:  # give the window back at once: the bench reads everything
                grant = _U32.pack(len(payload))
                self.transport.writelines(
                    [frame_head(WINDOW_UPDATE, 0, 0, 4), grant]
                    + ([frame_head(WINDOW_UPDATE, 0, stream_id, 4), grant] if call else [])
                )
            if flags & END_STREAM:
                self._done(stream_id)
        elif kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                if flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
                self.header_block = bytearray(payload)
                self.header_stream = stream_id
                self.header_end = bool(flags & END_STREAM)
            else:
                self.header_block += payload
            if flags & END_HEADERS:
                self._headers(self.header_stream, bytes(self.header_block), self.header_end)
        elif kind == SETTINGS:
            if not flags & ACK:
                for i in range(0, len(payload) - 5, 6):
                    key, value = _SETTING.unpack_from(payload, i)
                    if key == INITIAL_WINDOW_SIZE:
                        self.peer_window = value
                    elif key == MAX_FRAME_SIZE:
                        self.peer_frame = value
                    elif key == MAX_CONCURRENT_STREAMS:
                        self.max_streams = value
                self.transport.write(frame_head(SETTINGS, ACK, 0, 0))
                if self.ready is not None and not self.ready.done():
                    self.slots = asyncio.Semaphore(max(1, self.max_streams))
                    self.ready.set_result(None)
        elif kind == PING:
            if not flags & ACK:
                self.transport.write(frame_head(PING, ACK, 0, len(payload)) + payload)
        elif kind == RST_STREAM:
            call = self.calls.pop(stream_id, None)
            if call is not None and not call.future.done():
                call.future.set_exception(ConnectionError(f"stream {stream_id} was reset"))
        elif kind == GOAWAY:
            self.lost = ConnectionError("the server sent GOAWAY")
        # WINDOW_UPDATE, PRIORITY: requests stay within the first window

    def _headers(self, stream_id: int, block: bytes, end: bool) -> None:
        headers = self.decoder.decode(block)
        call = self.calls.get(stream_id)
        if call is None:
            return
        for name, value in headers:
            if name == b"grpc-status":
                call.status = int(value)
            elif name == b"grpc-message":
                call.message = value.decode("utf-8", "replace")
        if end:
            self._done(stream_id)

    def _done(self, stream_id: int) -> None:
        call = self.calls.pop(stream_id, None)
        if call is not None and not call.future.done():
            if call.status < 0:
                call.status, call.message = 13, "the stream ended without a grpc-status"
            call.future.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def connect(host: str, port: int) -> H2Connection:
    """A connection, once the server's SETTINGS are in."""
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: H2Connection(f"{host}:{port}"), host, port)
    assert conn.ready is not None
    await conn.ready
    return conn


__all__ = ["GrpcError", "H2Connection", "connect"]
