"""HTTP/2 (RFC 9113), the server side, as much as gRPC needs: pxrt's own framing.

grpcio's server costs ~250-300 us of CPU per call on this kind of machine before any
servicer code runs (``benchmarks/grpc_floor.py``), and the ``h2`` package ~270 us per
request/response in its state machine alone; pxrt's HTTP/1.1 path costs ~80 us in all.
This module is the lean alternative: frames are parsed with one ``struct`` call each,
header blocks are decoded by the Cython HPACK decoder (``serving.grpc._hpack``, or its
pure-Python twin), and everything a connection writes in one turn of the event loop
goes out in one ``writelines`` (the answers to a whole batch of calls: one system call).

``H2Protocol`` is an ``asyncio.Protocol`` that keeps the connection's state (settings,
both directions' flow-control windows, the HPACK context, the streams) and calls its
subclass for the streams' events:

- ``open_stream(stream_id, headers, end_stream)``: a new request's header list (a list
  of ``(name, value)`` bytes pairs); returns its ``Stream`` (or None, having answered or
  reset it);
- ``stream_data(stream, data, end_stream)``: a DATA frame's payload (a memoryview of the
  received bytes, valid as long as it is referenced);
- ``stream_end(stream)``: the client half-closed a stream that ended without data;
- ``stream_reset(stream, code)``: the client reset it, or the connection is gone.

The subclass answers with ``send_headers``, ``send_data`` (split into frames within the
peer's frame size and flow-control windows, queued while they are closed) and
``reset``. What the server advertises and enforces is ``Settings``; what a connection
may hold or take is ``Connections``'s (the cap, the handshake, idle and keepalive
timeouts, ping abuse, the drain).

Frames the server does not need are handled as the RFC says and otherwise ignored:
PRIORITY, unknown types, padding. PUSH_PROMISE from a client, a frame on stream 0 that
needs a stream (or the reverse), an idle stream's DATA, or a header block interleaved
with other frames end the connection with GOAWAY and the matching error code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import struct
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from pxrt._ext import twin

from ..accept import linger_allowance
from ..logs import RefusalLog
from .hpack_tables import STATIC_TABLE, HpackError

hpack = twin("serving.grpc._hpack", "serving.grpc._hpack_py")

log = logging.getLogger("pxrt.h2")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
# Flags
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# Error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
# Settings
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

LINGER_S = 2.0  # a connection closed after GOAWAY: how long what its client sends is dropped
RESET_WINDOW_S = 10.0  # client resets of open streams are counted over this
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535  # both directions' windows until SETTINGS / WINDOW_UPDATE say more
DEFAULT_FRAME = 16384  # the largest frame payload a peer takes until it says more

_HEAD = struct.Struct(">IBI")  # length << 8 | type, flags, stream id
_U32 = struct.Struct(">I")
_GOAWAY = struct.Struct(">II")
_SETTING = struct.Struct(">HI")


def frame_head(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    """A frame's 9-byte header."""
    return _HEAD.pack(length << 8 | kind, flags, stream_id)


class ConnectionFailed(Exception):
    """A connection error (RFC 9113 5.4.1): GOAWAY with ``code``, then the connection
    closes."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- HPACK out


def _hpack_int(value: int, prefix: int, first: int) -> bytes:
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_STATIC_NAMES: dict[bytes, int] = {}
for _i, (_name, _) in enumerate(STATIC_TABLE, 1):
    _STATIC_NAMES.setdefault(_name, _i)
_STATIC_FIELDS = {field: i for i, field in enumerate(STATIC_TABLE, 1)}


def encode_headers(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """An HPACK header block that leaves the peer's dynamic table alone: static-table
    fields by index, everything else a literal without indexing (no Huffman coding).
    The server's answers are a few short constant blocks, so a block can be made once
    and written many times, whatever the peer's decoder holds."""
    out = bytearray()
    for name, value in headers:
        index = _STATIC_FIELDS.get((name, value))
        if index is not None:
            out += _hpack_int(index, 7, 0x80)
            continue
        index = _STATIC_NAMES.get(name, 0)
        out += _hpack_int(index, 4, 0x00)
        if not index:
            out += _hpack_int(len(name), 7, 0) + name
        out += _hpack_int(len(value), 7, 0) + value
    return bytes(out)


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the server advertises in its SETTINGS and holds clients to.

    - ``max_concurrent_streams``: streams a client may have open at once; more are
      refused (REFUSED_STREAM: clients retry those).
    - ``initial_window``: bytes a client may send on a stream before the server says
      more; the server says more as it takes the data, except while a stream is held
      (``Stream.held``: a gRPC stream whose answers wait), so a client that sends faster
      than it is answered is held by flow control, not buffered.
    - ``connection_window``: the same over all of a connection's streams.
    - ``max_frame_size``: the largest frame payload the server takes (a larger frame is
      a FRAME_SIZE_ERROR).
    - ``max_header_list_size``: a request's decoded headers (RFC 9113's measure);
      decoding stops past it and the connection closes (a small HPACK block can name
      a large table entry many times over).
    - ``max_header_block``: a request's encoded header block, over its frames.
    """

    max_concurrent_streams: int = 1024
    initial_window: int = 1 << 20
    connection_window: int = 16 << 20
    max_frame_size: int = 1 << 20
    max_header_list_size: int = 16 << 10
    max_header_block: int = 64 << 10
    header_table_size: int = 4096

    def frames(self) -> bytes:
        """The server's connection preface: SETTINGS and the connection window's raise."""
        pairs = [
            (MAX_CONCURRENT_STREAMS, self.max_concurrent_streams),
            (INITIAL_WINDOW_SIZE, self.initial_window),
            (MAX_FRAME_SIZE, self.max_frame_size),
            (MAX_HEADER_LIST_SIZE, self.max_header_list_size),
            (ENABLE_PUSH, 0),
        ]
        body = b"".join(_SETTING.pack(k, v) for k, v in pairs)
        out = frame_head(SETTINGS, 0, 0, len(body)) + body
        if self.connection_window > DEFAULT_WINDOW:
            raise_by = _U32.pack(self.connection_window - DEFAULT_WINDOW)
            out += frame_head(WINDOW_UPDATE, 0, 0, 4) + raise_by
        return out


# --------------------------------------------------------------------------- streams


class Event(enum.Enum):
    """What moves a stream from one state to the next (``Stream.to``)."""

    RECV_END = (0, "the client's END_STREAM")
    END_QUEUED = (1, "the server's END_STREAM queued behind data waiting for the windows")
    SEND_END = (2, "the server's END_STREAM sent")
    RESET = (3, "a reset, either way, or the connection lost")

    def __init__(self, index: int, text: str) -> None:
        self.index = index  # in StreamState.moves
        self.text = text


class StreamState(enum.Enum):
    """A stream's state: RFC 9113's (5.1), with one of the server's own between open and
    half-closed (local): its END_STREAM queued behind data (or trailers) waiting for the
    client's windows, when it sends nothing more. ``_TRANSITIONS`` holds the moves."""

    #  (the client sent END_STREAM, the server sends no more, the server sent END_STREAM)
    OPEN = (False, False, False)
    HALF_CLOSED_REMOTE = (True, False, False)
    ENDING = (False, True, False)
    HALF_CLOSED_REMOTE_ENDING = (True, True, False)
    HALF_CLOSED_LOCAL = (False, True, True)
    CLOSED = (True, True, True)

    def __init__(self, remote_closed: bool, ending: bool, local_closed: bool) -> None:
        self.remote_closed = remote_closed
        self.ending = ending
        self.local_closed = local_closed
        #: The state each event leads to, by ``Event.index`` (None: not a move from
        #: here). Filled from ``_TRANSITIONS``: a tuple index on the hot path, where a
        #: dict keyed by enum members would hash them in Python.
        self.moves: tuple[StreamState | None, ...] = ()


_S, _E = StreamState, Event
_TRANSITIONS: dict[tuple[StreamState, Event], StreamState] = {
    (_S.OPEN, _E.RECV_END): _S.HALF_CLOSED_REMOTE,
    (_S.ENDING, _E.RECV_END): _S.HALF_CLOSED_REMOTE_ENDING,
    (_S.HALF_CLOSED_LOCAL, _E.RECV_END): _S.CLOSED,
    (_S.OPEN, _E.END_QUEUED): _S.ENDING,
    (_S.HALF_CLOSED_REMOTE, _E.END_QUEUED): _S.HALF_CLOSED_REMOTE_ENDING,
    (_S.OPEN, _E.SEND_END): _S.HALF_CLOSED_LOCAL,
    (_S.ENDING, _E.SEND_END): _S.HALF_CLOSED_LOCAL,
    (_S.HALF_CLOSED_REMOTE, _E.SEND_END): _S.CLOSED,
    (_S.HALF_CLOSED_REMOTE_ENDING, _E.SEND_END): _S.CLOSED,
    **{(state, _E.RESET): _S.CLOSED for state in _S},
}
for _state in _S:
    _state.moves = tuple(_TRANSITIONS.get((_state, event)) for event in _E)


class Stream:
    """One request/response exchange on a connection. ``H2Protocol`` owns the fields
    below; subclasses (``serving.grpc.native``) add their own slots."""

    __slots__ = (
        "id",
        "state",  # a StreamState: moved by ``to`` alone
        # The state's three facts, copied by ``to`` (read on every frame: a slot read):
        "remote_closed",  # the client sent END_STREAM (or the stream was reset)
        "ending",  # the server sent or queued its END_STREAM (or reset it): no more to send
        "local_closed",  # the server sent its END_STREAM (or the stream was reset)
        # What the server may still send on it (the peer's window) is the connection's
        # ``peer_initial_window`` plus this: the client's increments less what was sent.
        # A SETTINGS that changes the initial window changes every stream's at once.
        "send_credit",
        "recv_window",  # what the client may still send on it
        "unacked",  # received and not yet given back to the client's window
        "held",  # flow control: while set, the client's window is not given back
        "out",  # data waiting for the windows: 1-D byte views, in order
        "trailers",  # then this header block, with END_STREAM (else a bare END_STREAM)
        "waiting_since",  # when ``out`` last could not move (loop time; 0: it can)
    )

    def __init__(self, stream_id: int, recv_window: int) -> None:
        self.id = stream_id
        self.state = StreamState.OPEN
        self.remote_closed = self.ending = self.local_closed = False
        self.send_credit = 0
        self.recv_window = recv_window
        self.unacked = 0
        self.held = False
        self.out: list[memoryview] = []
        self.trailers: bytes | None = None
        self.waiting_since = 0.0

    def to(self, event: Event) -> None:
        """Move to the state ``event`` leads to (a move the table lacks is a bug)."""
        state = self.state.moves[event.index]
        if state is None:
            raise AssertionError(
                f"stream {self.id}: no move from {self.state.name} on {event.name}"
            )
        self.state = state
        self.remote_closed = state.remote_closed
        self.ending = state.ending
        self.local_closed = state.local_closed


def _view(part: Any) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# --------------------------------------------------------------------------- connections


class Connections:
    """What the connections of one listener may hold or take, and their sweep.

    - at most ``max_connections`` open at once: a new one beyond is sent GOAWAY
      (ENHANCE_YOUR_CALM) and closed at once, the refusals logged once per 10 s;
    - the client's preface and SETTINGS within ``handshake_timeout_s`` of connecting;
    - a connection with no open stream for ``idle_timeout_s`` is sent GOAWAY and closed;
    - one quiet for ``keepalive_s`` while streams are open is pinged, and closed if the
      ping is not answered within ``keepalive_timeout_s``;
    - a client that pings more often than ``min_client_ping_s`` with nothing else in
      between gets a strike; past ``max_ping_strikes`` it is sent GOAWAY
      (ENHANCE_YOUR_CALM, "too_many_pings", as grpc servers do) and closed;
    - a stream holding part of a message without progress for ``body_timeout_s`` is
      failed by its protocol (``H2Protocol.stalled``);
    - a client that resets more than ``max_client_resets`` open streams within
      ``RESET_WINDOW_S`` is sent GOAWAY (ENHANCE_YOUR_CALM): streams opened only to be
      reset make the server work for nothing (the 2023 "rapid reset" attack). Streams
      the server resets because of what the client sent (DATA after its END_STREAM, a
      zero WINDOW_UPDATE, a stream over the limit: the 2025 "MadeYouReset" attack) count
      the same;
    - frames that carry no request (SETTINGS, WINDOW_UPDATE, PRIORITY, RST_STREAM, an
      empty DATA, unknown types) are counted: a client may send ``max_control_frames``
      of them per ``RESET_WINDOW_S``, plus two per DATA frame the server sent it and one
      per stream it opened (what a client answering its data sends); past that it is
      sent GOAWAY (ENHANCE_YOUR_CALM). Each costs O(1): a new initial window applies to
      every stream at once (``Stream.send_credit``);
    - answers waiting for a client's flow-control windows are bounded: while a
      connection holds more than ``max_queued_bytes`` of them, its new streams are
      refused (REFUSED_STREAM: clients retry), and a stream whose answer has not moved
      for ``send_timeout_s`` is reset (CANCEL), its answer dropped. A client that
      advertises a zero window and never opens it holds nothing for long;
    - at most ``max_streams`` streams are open over all of the listener's connections
      (the process's), beyond each connection's ``Settings.max_concurrent_streams``;
      more are refused;
    - a header block's frames count with their headers against
      ``Settings.max_header_block`` (empty CONTINUATION frames cannot go on forever);
    - ``drain``: every connection is sent GOAWAY (streams open finish; new ones are
      refused), and closed once it has no stream left.

    One timer a listener checks them all every ``SWEEP_S``.
    """

    SWEEP_S = 0.25

    def __init__(
        self,
        settings: Settings,
        *,
        max_connections: int,
        handshake_timeout_s: float,
        idle_timeout_s: float,
        keepalive_s: float,
        keepalive_timeout_s: float,
        min_client_ping_s: float,
        max_ping_strikes: int = 2,
        body_timeout_s: float = 10.0,
        max_client_resets: int = 1000,
        max_control_frames: int = 1000,
        max_queued_bytes: int = 16 << 20,
        send_timeout_s: float = 30.0,
        max_streams: int = 8192,
    ) -> None:
        self.settings = settings
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.keepalive_s = keepalive_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.min_client_ping_s = min_client_ping_s
        self.max_ping_strikes = max_ping_strikes
        self.body_timeout_s = body_timeout_s
        self.max_client_resets = max_client_resets
        self.max_control_frames = max_control_frames
        self.max_queued_bytes = max_queued_bytes
        self.send_timeout_s = send_timeout_s
        self.max_streams = max_streams
        self.streams = 0  # open over every connection
        self.lingering = 0  # refused, GOAWAY sent, closing without a reset
        self.max_lingering = linger_allowance(max_connections)
        self.open: set[H2Protocol] = set()
        self.refusals = RefusalLog(kind="gRPC")
        self.draining = False
        self._timer: asyncio.TimerHandle | None = None
        self._preface = settings.frames()

    def admit(self, conn: H2Protocol) -> bool:
        """Whether ``conn`` (just connected) may stay; starts the sweep."""
        loop = conn.loop
        if len(self.open) >= self.max_connections or self.draining:
            if not self.draining:
                self.refusals.refused(loop.time(), len(self.open))
            return False
        self.open.add(conn)
        if self._timer is None:
            self._timer = loop.call_later(self.SWEEP_S, self._sweep, loop)
        return True

    def drain(self) -> None:
        """GOAWAY to every connection; each closes once its streams are done."""
        self.draining = True
        for conn in list(self.open):
            conn.go_away(NO_ERROR, b"draining")

    def close(self) -> None:
        """Close every connection now (their streams are reset)."""
        for conn in list(self.open):
            conn.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for conn in list(self.open):
            conn.check(now)
        if self.open:
            self._timer = loop.call_later(self.SWEEP_S, self._sweep, loop)
        else:
            self._timer = None


# --------------------------------------------------------------------------- protocol


S = TypeVar("S", bound=Stream)


class H2Protocol(asyncio.Protocol, Generic[S]):
    """One HTTP/2 connection, server side (see the module's docstring)."""

    loop: asyncio.AbstractEventLoop
    transport: Any

    def __init__(self, connections: Connections, stream_class: type[S]) -> None:
        self.stream_class = stream_class  # what the subclass's streams are
        self.connections = connections
        settings = self.settings = connections.settings
        self.decoder = hpack.Decoder(settings.header_table_size, settings.max_header_list_size)
        self.streams: dict[int, S] = {}
        self.last_stream_id = 0  # the highest the client opened
        self.closed = False
        self.going_away = False  # GOAWAY sent: no new streams
        self._pending: list[bytes] = []  # bytes received that are not yet a whole frame
        self._pending_size = 0
        self._need = len(PREFACE)  # bytes needed before the next frame can be read
        self._preface = False
        # A header block in frames: (stream, flags, fragments, its bytes with the frames'
        # headers: empty CONTINUATION frames count too, so they cannot go on forever).
        self._headers_in: tuple[int, int, list] | None = None
        self._headers_size = 0
        self._resets = 0  # streams reset by (or because of) the client, since _resets_since
        self._resets_since = 0.0
        self._control_left = connections.max_control_frames  # (see Connections)
        self._control_since = 0.0
        self.peer_window = DEFAULT_WINDOW  # what the server may still send, all streams
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.recv_window = settings.connection_window
        self._consumed = 0  # received and not yet given back to the connection's window
        self._blocked: dict[int, S] = {}  # streams whose data waits for peer_window
        self._starved: dict[int, S] = {}  # streams whose data waits for their window
        self.queued_bytes = 0  # of data waiting in the streams' ``out``
        self._out: list[Any] = []  # buffers to write at the end of this turn of the loop
        self._flushing = False
        self._reading = True
        # timing (loop.time())
        self.opened = self.last_frame = self.idle_since = 0.0
        self.settled = False  # the client's first SETTINGS came
        self._ping_sent = 0.0  # our keepalive ping, unanswered since
        self._last_ping = -1e9  # the client's last ping
        self._ping_strikes = 0
        self._quiet = True  # no headers or data either way since the client's last ping
        self._peer_table_size = 4096  # the peer's HPACK table size for the server's blocks
        self._table_update = b""  # a size update the next block the server sends starts with
        self._linger_until = 0.0  # closed, FIN sent: aborted by then if the client is not

    # ------------------------------------------------------------------ asyncio

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.opened = self.last_frame = self.idle_since = self.loop.time()
        conns = self.connections
        if not conns.admit(self):
            self.closed = True
            body = _GOAWAY.pack(0, ENHANCE_YOUR_CALM) + b"too many connections"
            goaway = frame_head(GOAWAY, 0, 0, len(body)) + body
            transport.write(conns._preface + goaway)  # SETTINGS come first
            # Closed without a reset (which could lose the GOAWAY: the client's preface
            # is unread) while few linger: FIN, what comes dropped, aborted after LINGER_S.
            if conns.lingering >= conns.max_lingering or not transport.can_write_eof():
                transport.close()
                return
            conns.lingering += 1
            transport.write_eof()
            self.loop.call_later(LINGER_S, self._linger_over, transport)
            return
        self._write(self.connections._preface)

    def _linger_over(self, transport: Any) -> None:
        self.connections.lingering -= 1
        transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.connections.open.discard(self)
        streams = list(self.streams.values())
        self.streams.clear()
        self.connections.streams -= len(streams)
        for stream in streams:
            self._drop_out(stream)
            stream.to(Event.RESET)
            self.stream_reset(stream, CANCEL)

    def pause_writing(self) -> None:
        # A client that does not read its answers is not read either.
        if self._reading and not self.closed:
            self._reading = False
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self._reading and not self.closed:
            self._reading = True
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self._pending:
            self._pending.append(data)
            self._pending_size += len(data)
            if self._pending_size < self._need:
                return
            data = b"".join(self._pending)
            self._pending = []
        elif len(data) < self._need:
            self._pending = [data]
            self._pending_size = len(data)
            return
        try:
            used = self._frames(data)
        except ConnectionFailed as exc:
            self.fail(exc.code, str(exc))
            return
        except HpackError as exc:
            self.fail(COMPRESSION_ERROR, f"HPACK: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - a bug: the connection's state is lost
            log.exception("pxrt: HTTP/2 connection failed")
            self.fail(INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
            return
        if used < len(data) and not self.closed:
            rest = data[used:]
            self._pending = [rest]
            self._pending_size = len(rest)

    # ------------------------------------------------------------------ frames in

    def _frames(self, data: bytes) -> int:
        """Handle every whole frame in ``data``; returns the bytes used."""
        pos = 0
        end = len(data)
        if not self._preface:
            if data[: len(PREFACE)] != PREFACE:
                raise ConnectionFailed(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._preface = True
            pos = len(PREFACE)
        self.last_frame = self.loop.time()
        view = memoryview(data)
        unpack = _HEAD.unpack_from
        max_frame = self.settings.max_frame_size
        while end - pos >= 9 and not self.closed:
            head, flags, stream_id = unpack(data, pos)
            length = head >> 8
            if length > max_frame:
                raise ConnectionFailed(
                    FRAME_SIZE_ERROR,
                    f"a frame of {length} bytes (SETTINGS_MAX_FRAME_SIZE {max_frame})",
                )
            stop = pos + 9 + length
            if stop > end:
                self._need = 9 + length
                return pos
            kind = head & 0xFF
            stream_id &= 0x7FFFFFFF
            payload = view[pos + 9 : stop]
            pos = stop
            if self._headers_in is not None and kind != CONTINUATION:
                raise ConnectionFailed(
                    PROTOCOL_ERROR, "a header block interrupted by another frame"
                )
            if kind == DATA:
                if not length and not flags & END_STREAM:
                    self._control_frame()
                self._data(stream_id, flags, payload)
            elif kind == HEADERS:
                self._headers(stream_id, flags, payload)
            elif kind == PING:
                self._ping(stream_id, flags, payload)
            elif kind == CONTINUATION:
                self._continuation(stream_id, flags, payload)
            else:
                self._control_frame()
                self._other(kind, stream_id, flags, length, payload)
        self._need = 9
        return pos

    def _other(
        self, kind: int, stream_id: int, flags: int, length: int, payload: memoryview
    ) -> None:
        """A frame that carries no request (counted as one by ``_frames``)."""
        if kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == SETTINGS:
            self._settings(stream_id, flags, payload)
        elif kind == RST_STREAM:
            self._rst_stream(stream_id, payload)
        elif kind == GOAWAY:
            if stream_id:
                raise ConnectionFailed(PROTOCOL_ERROR, "GOAWAY on a stream")
            if length < 8:
                raise ConnectionFailed(FRAME_SIZE_ERROR, "a GOAWAY frame under 8 bytes")
            self.going_away = True  # the client leaves: no new streams, then close
            self._maybe_done()
        elif kind == PRIORITY:
            if not stream_id:
                raise ConnectionFailed(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if length != 5:
                raise ConnectionFailed(FRAME_SIZE_ERROR, "a PRIORITY frame is 5 bytes")
        elif kind == PUSH_PROMISE:
            raise ConnectionFailed(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # other types are ignored (RFC 9113 4.1)

    def _control_frame(self) -> None:
        """Count a frame that carries no request against the client's allowance
        (``Connections``): past it, the connection is sent away."""
        now = self.last_frame
        if now - self._control_since > RESET_WINDOW_S:
            self._control_since = now
            self._control_left = self.connections.max_control_frames
        self._control_left -= 1
        if self._control_left < 0:
            raise ConnectionFailed(ENHANCE_YOUR_CALM, "too many control frames")

    @staticmethod
    def _unpad(flags: int, payload: memoryview, what: str) -> memoryview:
        if not flags & PADDED:
            return payload
        if not payload:
            raise ConnectionFailed(PROTOCOL_ERROR, f"a padded {what} frame without its pad length")
        pad = payload[0]
        if pad >= len(payload):
            raise ConnectionFailed(
                PROTOCOL_ERROR, f"a {what} frame's padding is not shorter than it"
            )
        return payload[1 : len(payload) - pad]

    def _data(self, stream_id: int, flags: int, payload: memoryview) -> None:
        if not stream_id:
            raise ConnectionFailed(PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)  # padding included: it counts against the windows
        self.recv_window -= length
        if self.recv_window < 0:
            raise ConnectionFailed(FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        self._consumed += length
        if self._consumed >= self.settings.connection_window >> 1:
            self._write(frame_head(WINDOW_UPDATE, 0, 0, 4), _U32.pack(self._consumed))
            self.recv_window += self._consumed
            self._consumed = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise ConnectionFailed(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream already closed or reset: dropped
        if stream.remote_closed:
            self.reset(stream_id, STREAM_CLOSED)
            return
        stream.recv_window -= length
        if stream.recv_window < 0:
            self.reset(stream_id, FLOW_CONTROL_ERROR)
            return
        stream.unacked += length
        self._quiet = False
        end = bool(flags & END_STREAM)
        if end:
            stream.to(Event.RECV_END)
        data = self._unpad(flags, payload, "DATA")
        self.stream_data(stream, data, end)
        if end:
            self._maybe_closed(stream)
        elif not stream.held and stream.unacked >= self.settings.initial_window >> 1:
            self._ack(stream)

    def _ack(self, stream: S) -> None:
        """Give back what was received on ``stream`` to the client's window."""
        if stream.unacked and not stream.remote_closed and not stream.local_closed:
            self._write(frame_head(WINDOW_UPDATE, 0, stream.id, 4), _U32.pack(stream.unacked))
            stream.recv_window += stream.unacked
        stream.unacked = 0

    def _headers(self, stream_id: int, flags: int, payload: memoryview) -> None:
        if not stream_id:
            raise ConnectionFailed(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, payload, "HEADERS")
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ConnectionFailed(
                    FRAME_SIZE_ERROR, "a HEADERS frame too short for its priority"
                )
            block = block[5:]
        if not flags & END_HEADERS:
            self._headers_in = (stream_id, flags, [bytes(block)])
            self._headers_size = 9 + len(block)
            self._check_block_size()
            return
        self._header_block(stream_id, flags, block)

    def _continuation(self, stream_id: int, flags: int, payload: memoryview) -> None:
        pending = self._headers_in
        if pending is None or pending[0] != stream_id:
            raise ConnectionFailed(PROTOCOL_ERROR, "CONTINUATION out of place")
        pending[2].append(bytes(payload))
        self._headers_size += 9 + len(payload)
        self._check_block_size()
        if flags & END_HEADERS:
            self._headers_in = None
            self._header_block(stream_id, pending[1], b"".join(pending[2]))

    def _check_block_size(self) -> None:
        if self._headers_size > self.settings.max_header_block:
            raise ConnectionFailed(
                ENHANCE_YOUR_CALM, f"a header block over {self.settings.max_header_block} bytes"
            )

    def _header_block(self, stream_id: int, flags: int, block: Any) -> None:
        headers = self.decoder.decode(block)  # always: the HPACK context must stay in step
        end = bool(flags & END_STREAM)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers: what gRPC clients never send; the end of it
            if stream.remote_closed or not end:
                self.reset(stream_id, PROTOCOL_ERROR)
                return
            stream.to(Event.RECV_END)
            self._quiet = False
            self.stream_end(stream)
            self._maybe_closed(stream)
            return
        if stream_id <= self.last_stream_id:
            if stream_id % 2 == 0:
                raise ConnectionFailed(PROTOCOL_ERROR, f"HEADERS on even stream {stream_id}")
            self.reset(stream_id, STREAM_CLOSED)  # (a stream it reset or we closed)
            return
        if stream_id % 2 == 0:
            raise ConnectionFailed(PROTOCOL_ERROR, f"a client opened even stream {stream_id}")
        self.last_stream_id = stream_id
        self._quiet = False
        conns = self.connections
        if (
            self.going_away
            or len(self.streams) >= self.settings.max_concurrent_streams
            or conns.streams >= conns.max_streams
            or self.queued_bytes > conns.max_queued_bytes  # (a client not reading its answers)
        ):
            self.reset(stream_id, REFUSED_STREAM)  # clients retry these elsewhere
            return
        stream = self.stream_class(stream_id, self.settings.initial_window)
        if end:
            stream.to(Event.RECV_END)
        self.streams[stream_id] = stream
        conns.streams += 1
        self._control_left += 1  # (its RST_STREAM, PRIORITY or WINDOW_UPDATE are fair)
        self.open_stream(stream, headers)

    def _window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise ConnectionFailed(FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame is 4 bytes")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise ConnectionFailed(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self.peer_window += increment
            if self.peer_window > MAX_WINDOW:
                raise ConnectionFailed(FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
            while self._blocked and self.peer_window > 0:
                self._send_queued(next(iter(self._blocked.values())))  # (blocked again if
            return  # the window runs out)
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise ConnectionFailed(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
            return
        if not increment:
            self.reset(stream_id, PROTOCOL_ERROR)
            return
        stream.send_credit += increment
        if self.peer_initial_window + stream.send_credit > MAX_WINDOW:
            self.reset(stream_id, FLOW_CONTROL_ERROR)
            return
        if stream.out or stream.trailers is not None:
            self._send_queued(stream)

    def _ping(self, stream_id: int, flags: int, payload: memoryview) -> None:
        if stream_id:
            raise ConnectionFailed(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionFailed(FRAME_SIZE_ERROR, "a PING frame is 8 bytes")
        if flags & ACK:
            self._ping_sent = 0.0
            return
        now = self.loop.time()
        if not self._quiet:  # headers or data went either way since the last ping
            self._ping_strikes = 0
        elif now - self._last_ping < self.connections.min_client_ping_s:
            self._ping_strikes += 1
            if self._ping_strikes > self.connections.max_ping_strikes:
                self.go_away(ENHANCE_YOUR_CALM, b"too_many_pings")
                self.close_soon()
                return
        self._last_ping = now
        self._quiet = True
        self._write(frame_head(PING, ACK, 0, 8), bytes(payload))

    def _settings(self, stream_id: int, flags: int, payload: memoryview) -> None:
        if stream_id:
            raise ConnectionFailed(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionFailed(FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ConnectionFailed(FRAME_SIZE_ERROR, "a SETTINGS frame not a multiple of 6 bytes")
        values = dict(_SETTING.iter_unpack(payload))  # the last value of each counts
        window = values.get(INITIAL_WINDOW_SIZE)
        if window is not None:
            if window > MAX_WINDOW:
                raise ConnectionFailed(
                    FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1"
                )
            # Every stream's window moves with it (``Stream.send_credit``): O(1), but for
            # the streams whose data waited for their windows, which may now go on. (A
            # stream's window over 2^31-1 is caught at its next WINDOW_UPDATE.)
            grew = window > self.peer_initial_window
            self.peer_initial_window = window
            if grew:
                for stream in list(self._starved.values()):
                    self._send_queued(stream)
        frame = values.get(MAX_FRAME_SIZE)
        if frame is not None:
            if not DEFAULT_FRAME <= frame <= (1 << 24) - 1:
                raise ConnectionFailed(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {frame}")
            self.peer_max_frame = frame
        if values.get(ENABLE_PUSH, 0) > 1:
            raise ConnectionFailed(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {values[ENABLE_PUSH]}")
        table = values.get(HEADER_TABLE_SIZE)
        if table is not None and table < self._peer_table_size:
            # The server's blocks never use the peer's table, but a peer that shrinks it
            # expects the next block to say so (RFC 7541 4.2).
            self._peer_table_size = table
            self._table_update = _hpack_int(table, 5, 0x20)
        # The rest limit what the server never does (push, open streams).
        self.settled = True
        self._write(frame_head(SETTINGS, ACK, 0, 0))

    def _rst_stream(self, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            raise ConnectionFailed(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ConnectionFailed(FRAME_SIZE_ERROR, "an RST_STREAM frame is 4 bytes")
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise ConnectionFailed(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
            return
        self._gone(stream)
        self._closed_one()
        self.stream_reset(stream, _U32.unpack(payload)[0])
        self._count_reset()

    def _count_reset(self) -> None:
        """A stream reset by the client, or by the server for what the client sent: a
        client that makes the server work for streams only to reset them (the "rapid
        reset" and "MadeYouReset" attacks) is sent away past the limit in a window."""
        now = self.last_frame
        if now - self._resets_since > RESET_WINDOW_S:
            self._resets, self._resets_since = 0, now
        self._resets += 1
        if self._resets > self.connections.max_client_resets:
            self.fail(ENHANCE_YOUR_CALM, "too many streams reset")

    # ------------------------------------------------------------------ frames out

    def _write(self, *parts: Any) -> None:
        """Queue buffers to write; they go out together at the end of this turn of the
        event loop (the answers of a whole batch: one system call)."""
        self._out.extend(parts)
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        out = self._out
        if out and not self.closed:
            self._out = []
            self.transport.writelines(out)

    def _block(self, block: bytes) -> bytes:
        """A header block the server sends, after any table size update it owes."""
        if self._table_update:
            block, self._table_update = self._table_update + block, b""
        return block

    def send_headers(self, stream: S, block: bytes, end_stream: bool = False) -> None:
        """Send a header block on ``stream`` (with ``end_stream``: after its queued data,
        if any; nothing is sent on it after that)."""
        if stream.ending:
            return
        self._quiet = False
        if end_stream and stream.out:
            stream.to(Event.END_QUEUED)
            stream.trailers = block  # after the data waiting for the windows
            return
        self._headers_out(stream, block, end_stream)

    def _headers_out(self, stream: S, block: bytes, end_stream: bool) -> None:
        block = self._block(block)
        max_frame = self.peer_max_frame
        flags = END_STREAM if end_stream else 0
        if len(block) <= max_frame:
            self._write(frame_head(HEADERS, flags | END_HEADERS, stream.id, len(block)), block)
        else:
            chunks = [block[i : i + max_frame] for i in range(0, len(block), max_frame)]
            self._write(frame_head(HEADERS, flags, stream.id, len(chunks[0])), chunks[0])
            for i, chunk in enumerate(chunks[1:], 2):
                last = END_HEADERS if i == len(chunks) else 0
                self._write(frame_head(CONTINUATION, last, stream.id, len(chunk)), chunk)
        if end_stream:
            self._end_local(stream)

    def send_response(
        self, stream: S, headers: bytes, parts: Sequence[Any], trailers: bytes
    ) -> None:
        """A whole answer on ``stream``: ``headers``, ``parts`` as one DATA frame, and
        ``trailers`` that end it, in one write when the windows and the peer's frame
        size allow (the common case: small answers), else as ``send_headers``,
        ``send_data`` and ``send_headers`` would."""
        if stream.ending:
            return
        length = sum(map(len, parts))
        sid = stream.id
        if (
            stream.out
            or self._table_update
            or length > self.peer_window
            or length > self.peer_initial_window + stream.send_credit
            or length > self.peer_max_frame
            or len(headers) > self.peer_max_frame
            or len(trailers) > self.peer_max_frame
        ):
            self.send_headers(stream, headers)
            self.send_data(stream, parts)
            self.send_headers(stream, trailers, end_stream=True)
            return
        self._quiet = False
        self.peer_window -= length
        stream.send_credit -= length
        self._control_left += 2
        pack = _HEAD.pack
        self._write(
            pack(len(headers) << 8 | HEADERS, END_HEADERS, sid), headers,
            pack(length << 8 | DATA, 0, sid), *parts,
            pack(len(trailers) << 8 | HEADERS, END_HEADERS | END_STREAM, sid), trailers,
        )  # fmt: skip
        self._end_local(stream)

    def send_data(self, stream: S, parts: Sequence[Any], end_stream: bool = False) -> None:
        """Send ``parts`` (bytes-like) as DATA on ``stream``: at once as far as the
        peer's windows and frame size allow, the rest queued until they open
        (``stream.out``; ``stream_drained`` is called once it has all gone). Data that
        would wait while the connection already holds ``max_queued_bytes`` waiting is
        not queued: ``overflow`` ends the stream instead."""
        if stream.ending:
            return
        self._quiet = False
        length = sum(map(len, parts)) if len(parts) != 1 else len(parts[0])
        if (
            not stream.out
            and length <= self.peer_window
            and length <= self.peer_initial_window + stream.send_credit
            and length <= self.peer_max_frame
        ):
            self.peer_window -= length
            stream.send_credit -= length
            self._control_left += 2
            self._write(
                frame_head(DATA, END_STREAM if end_stream else 0, stream.id, length), *parts
            )
            if end_stream:
                self._end_local(stream)
            return
        if self.queued_bytes > self.connections.max_queued_bytes:
            self.overflow(stream)
            return
        if end_stream:
            stream.to(Event.END_QUEUED)  # (a bare END_STREAM: no trailers)
        views = [_view(p) for p in parts if len(p)]
        stream.out.extend(views)
        self.queued_bytes += sum(map(len, views))
        self._send_queued(stream)

    def _send_queued(self, stream: S) -> None:
        """Send what ``stream`` has queued, as far as the windows allow (else it waits
        in ``_blocked`` for the connection's window or ``_starved`` for its own)."""
        self._blocked.pop(stream.id, None)
        self._starved.pop(stream.id, None)
        out = stream.out
        moved = False
        while out:
            window = self.peer_initial_window + stream.send_credit
            room = min(self.peer_window, window, self.peer_max_frame)
            if room <= 0:
                waiting = self._blocked if self.peer_window <= 0 else self._starved
                waiting[stream.id] = stream
                if moved or not stream.waiting_since:
                    stream.waiting_since = self.loop.time()
                return
            parts: list[memoryview] = []
            size = 0
            while out and size < room:
                part = out[0]
                if len(part) <= room - size:
                    parts.append(part)
                    size += len(part)
                    out.pop(0)
                else:
                    parts.append(part[: room - size])
                    out[0] = part[room - size :]
                    size = room
            self.peer_window -= size
            stream.send_credit -= size
            self.queued_bytes -= size
            self._control_left += 2
            moved = True
            last = not out and stream.ending and stream.trailers is None
            self._write(frame_head(DATA, END_STREAM if last else 0, stream.id, size), *parts)
            if last:
                stream.waiting_since = 0.0
                self._end_local(stream)
                return
        stream.waiting_since = 0.0
        if stream.trailers is not None:
            trailers, stream.trailers = stream.trailers, None
            self._headers_out(stream, trailers, end_stream=True)
        elif stream.ending:  # (its END_STREAM queued, without trailers)
            self._write(frame_head(DATA, END_STREAM, stream.id, 0))
            self._end_local(stream)
        else:
            self.stream_drained(stream)

    def reset(self, stream_id: int, code: int) -> None:
        """RST_STREAM: the server is done with the stream (``stream_reset`` is called
        for it, as for one the client resets). A reset for what the client sent (any
        code but NO_ERROR and CANCEL) counts as the client's (``_count_reset``)."""
        self._write(frame_head(RST_STREAM, 0, stream_id, 4), _U32.pack(code))
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self._gone(stream)
            self.stream_reset(stream, code)
            self._closed_one()
        if code not in (NO_ERROR, CANCEL):
            self._count_reset()

    def _gone(self, stream: S) -> None:
        """``stream`` (just taken out of ``streams``) is over: nothing more either way,
        and what it had queued is dropped."""
        stream.to(Event.RESET)
        self.connections.streams -= 1
        self._drop_out(stream)

    def _drop_out(self, stream: S) -> None:
        if stream.out:
            self.queued_bytes -= sum(map(len, stream.out))
            stream.out.clear()
        stream.trailers = None
        self._blocked.pop(stream.id, None)
        self._starved.pop(stream.id, None)

    def release(self, stream: S) -> None:
        """Stop holding ``stream``: give the client back the window it used."""
        stream.held = False
        if stream.unacked:
            self._ack(stream)

    def _end_local(self, stream: S) -> None:
        stream.to(Event.SEND_END)
        if not stream.remote_closed:
            # Answered before the client finished sending: ask it to stop (RFC 9113 8.1).
            self.reset(stream.id, NO_ERROR)
            return
        self._maybe_closed(stream)

    def _maybe_closed(self, stream: S) -> None:
        if stream.local_closed and stream.remote_closed:
            if self.streams.pop(stream.id, None) is not None:
                self.connections.streams -= 1
                self._closed_one()

    def _closed_one(self) -> None:
        if not self.streams:
            self.idle_since = self.loop.time()
            self._maybe_done()

    def _maybe_done(self) -> None:
        if self.going_away and not self.streams:
            self.close_soon()

    def go_away(self, code: int, debug: bytes = b"") -> None:
        """GOAWAY: streams open go on; new ones are refused."""
        if self.closed:
            return
        if not self.going_away or code != NO_ERROR:
            body = _GOAWAY.pack(self.last_stream_id, code) + debug
            self._write(frame_head(GOAWAY, 0, 0, len(body)), body)
        self.going_away = True
        self._maybe_done()

    def fail(self, code: int, message: str) -> None:
        """A connection error: GOAWAY with ``code`` and ``message``, then close."""
        if self.closed:
            return
        log.info("pxrt: HTTP/2 connection error %#x: %s", code, message)
        self.going_away = False  # (a second GOAWAY, with the error)
        self.go_away(code, message.encode()[:256])
        self.close_soon()

    def close_soon(self) -> None:
        """Close after what is queued (a GOAWAY) without a reset: closing a socket whose
        client sent bytes not yet read makes the kernel answer RST, and the client may
        lose the GOAWAY just written. So: FIN after it, and what the client still sends
        is dropped until it closes or ``LINGER_S`` pass (the sweep aborts it then)."""
        if self.closed:
            return
        self._flush()
        self.closed = True
        transport = self.transport
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:  # the client is gone already
                transport.abort()
                return
            self._linger_until = self.loop.time() + LINGER_S
        else:  # TLS: no half-close
            transport.close()

    def close(self) -> None:
        if not self.closed:
            self._flush()
            self.closed = True
            self.transport.close()

    # ------------------------------------------------------------------ timing

    def check(self, now: float) -> None:
        """The sweep (``Connections``): handshake, idle, keepalive and stalled bodies."""
        conns = self.connections
        if self.closed:
            if self._linger_until and now > self._linger_until:
                self._linger_until = 0.0
                self.transport.abort()
            return
        if not self.settled:
            if now - self.opened > conns.handshake_timeout_s:
                self.transport.close()  # nothing sent in time: not worth a GOAWAY
                self.closed = True
            return
        if self._ping_sent:
            if now - self._ping_sent > conns.keepalive_timeout_s:
                self.fail(NO_ERROR, "the client did not answer a keepalive ping")
                return
        elif now - self.last_frame > conns.keepalive_s:
            self._ping_sent = now
            self._write(frame_head(PING, 0, 0, 8), b"pxrtkeep")
        if self._blocked or self._starved:
            since = now - conns.send_timeout_s
            for stream in [*self._blocked.values(), *self._starved.values()]:
                if stream.waiting_since < since:
                    self.reset(stream.id, CANCEL)  # its answer did not move: dropped
        if not self.streams:
            if now - self.idle_since > conns.idle_timeout_s:
                self.go_away(NO_ERROR, b"idle")
            return
        self.sweep_streams(now)

    # ------------------------------------------------------------------ subclass

    def open_stream(self, stream: S, headers: list) -> None:
        """A new stream (``stream.remote_closed`` if its HEADERS ended it) and its
        request's header list."""
        raise NotImplementedError

    def stream_data(self, stream: S, data: memoryview, end_stream: bool) -> None:
        raise NotImplementedError

    def stream_end(self, stream: S) -> None:
        """The client half-closed ``stream`` without data (trailers, or an empty end)."""
        self.stream_data(stream, memoryview(b""), True)

    def stream_reset(self, stream: S, code: int) -> None:
        """``stream`` is gone: reset by the client (``code`` its error code) or the
        server, or its connection lost (CANCEL); or answered while the client was still
        sending (NO_ERROR). Called once per stream."""
        raise NotImplementedError

    def stream_drained(self, stream: S) -> None:
        """What ``stream`` had queued for the peer's windows has all been sent."""

    def overflow(self, stream: S) -> None:
        """Data for ``stream`` would wait for the client's windows while the connection
        already holds ``Connections.max_queued_bytes`` waiting: end the stream instead
        (here with RST_STREAM CANCEL; a subclass answers with its protocol's error)."""
        self.reset(stream.id, CANCEL)

    def sweep_streams(self, now: float) -> None:
        """The sweep's turn for the streams (``Connections.body_timeout_s``: fail those
        holding part of a message that stopped coming)."""


__all__ = [
    "PREFACE",
    "ConnectionFailed",
    "Connections",
    "H2Protocol",
    "Settings",
    "Stream",
    "encode_headers",
    "frame_head",
]
