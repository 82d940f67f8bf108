"""The native HTTP path of ``pxrt serve``: inference and health answered straight from
the HTTP parser's callbacks, without the ASGI stack.

Starlette on uvicorn costs ~200 us of CPU per request before pxrt's request core runs
(the ASGI scope and messages, a task per request, routing, the Request and Response
objects); the core itself costs a few. ``NativeInferProtocol`` sits under the connection
guard (``serving.http.limits``) in uvicorn's httptools protocol and takes, when the
connection has no other request in progress:

- ``POST /v2/models/{model}[/versions/{version}]/infer``: the restricted-API key, the
  declared length, the model's readiness and existence are checked once the headers are
  in (and answered at once, the rest of the body discarded); the body is gathered
  within the same per-request limit and app-wide budget as the ASGI path
  (``serving.http.app.Upload``); then the request core decodes it (binary tensors as views
  of the received bytes, JSON through the Cython walk) and queues it
  (``serving.kserve.core.start``), and the future's callback writes the reply with
  ``writelines`` (status line and headers, the JSON header, each output's bytes: never
  joined). No task or coroutine per request.
- ``POST /v2/models/{model}[/versions/{version}]/generate_stream`` (generation, as
  server-sent events): checked and gathered the same way, submitted (one task, until the
  decoder accepts it), then each step's tokens are written as one chunk from the
  generation's listener (``pxrt.Generation.listen``): no task, future or async
  generator per token. The events are those of the ASGI path (``serving.kserve.generation``'s
  ``KServeCall``); a client that hangs up cancels the generation.
- ``GET /v2/health/live`` and ``/v2/health/ready``.

Everything else (metadata, config, statistics, repository, metrics, and a request sent
while another is in progress on the same connection) goes through the Starlette app as
before; the status codes, error bodies and headers are the same on both paths (the same
helpers make them), and the guard's limits (431, 408, the connection cap, drain) apply
to both. A client that hangs up cancels its request's future, which takes it out of
the queue if it was not dispatched yet.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..access import header_values
from ..kserve import codec, core
from ..kserve.core import TooLarge, Upload
from .app import HEADER_LENGTH, AppState, error_reply, fast_route, readiness, request_decoder

if TYPE_CHECKING:
    from ..kserve.backend import ServedModel


_STATUS = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in http.HTTPStatus}
_STATUS[499] = b"HTTP/1.1 499 Client Closed Request\r\n"
_JSON = b"content-type: application/json\r\n"
_BINARY = b"content-type: application/octet-stream\r\n"
_CLOSE = b"connection: close\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LENGTH_HEADER = HEADER_LENGTH.encode()

_INFER, _LIVE, _READY, _STREAM = "inference", "live", "ready", "generate_stream"
_STREAM_SUFFIX = "/generate_stream"
_SSE_HEAD = (
    b"content-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n"
)


ROUTES_CACHED = 1024  # (method, URL) -> route, remembered (least recently used go)
ROUTE_URL_BYTES = 256  # longer URLs are routed each time (any URL may come)


def route(method: bytes, url: bytes) -> tuple[str, str, str | None] | None:
    """``(kind, model, version)`` of a request the native path answers, else None."""
    if len(url) <= ROUTE_URL_BYTES:
        return _cached_route(method, url)
    return _route(method, url)


def _route(method: bytes, url: bytes) -> tuple[str, str, str | None] | None:
    try:
        path = httptools.parse_url(url).path.decode("ascii")
    except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
        return None
    if "%" in path:
        path = unquote(path)
    if method == b"POST" and path.endswith(_STREAM_SUFFIX):
        found = fast_route("POST", path[: -len(_STREAM_SUFFIX)] + "/infer")
        return None if found is None else (_STREAM, found[1], found[2])
    return fast_route(method.decode("latin-1"), path)


_cached_route = functools.lru_cache(maxsize=ROUTES_CACHED)(_route)


class _NoEvent:
    """What uvicorn and the guard set on a cycle's ``message_event``: nothing waits."""

    @staticmethod
    def set() -> None:
        pass


_NO_EVENT = _NoEvent()


class NativeCycle:
    """One request on the native path (in ``protocol.cycle``, where uvicorn keeps its
    request-response cycle: the guard and uvicorn read the same attributes)."""

    __slots__ = (
        "disconnected",
        "header_length",
        "keep_alive",
        "kind",
        "message_event",
        "name",
        "pending",
        "proto",
        "queued",
        "response_complete",
        "upload",
        "version",
    )

    def __init__(
        self, proto: NativeInferProtocol, kind: str, name: str, version: str | None
    ) -> None:
        self.proto = proto
        self.kind = kind
        self.name = name
        self.version = version
        parser = proto.parser
        self.keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        self.response_complete = False
        self.disconnected = False
        self.message_event = _NO_EVENT
        self.upload: Upload | None = None
        self.header_length: str | None = None
        self.queued: core.Pending | None = None  # the request, once in the queue
        self.pending: BaseException | None = None  # answered once the body is in

    # ------------------------------------------------------------------ the request

    def headers_complete(self, state: AppState) -> None:
        """Checks that need only the headers, in the ASGI path's order. Their error is
        answered once the body is in (the body is not kept), so the connection stays
        usable; a body that will not be taken (over the limit) or that the client waits
        to be asked for (``Expect: 100-continue``) is answered now, and the connection
        closed after it."""
        proto = self.proto
        headers = proto.headers
        try:
            group = _INFER if self.kind in (_INFER, _STREAM) else "health"
            state.restrictions.check(group, header_values(headers))
            if self.kind not in (_INFER, _STREAM):
                return
            length = None
            for name, value in headers:
                if name == b"content-length":
                    length = value
                elif name == _LENGTH_HEADER:
                    self.header_length = value.decode("latin-1")
            if self.kind == _STREAM:
                core.serving(state.server).decoder(self.name)  # before the body
            else:
                core.resolve(state.server, self.name, self.version)  # before the body
            if self.kind == _STREAM:
                from ..kserve.generation import upload

                self.upload = upload(state.server, state.budget, length)
            else:
                self.upload = Upload(state.budget, state.limits.max_body_bytes, length)
        except TooLarge as exc:
            self.fail(exc, early=True)
            return
        except Exception as exc:  # noqa: BLE001 - answered by the error table
            if proto.expect_100_continue:
                self.fail(exc, early=True)
            else:
                self.pending = exc
            return
        if proto.expect_100_continue:
            proto.transport.write(_CONTINUE)

    def body(self, chunk: bytes) -> None:
        if self.upload is None:
            return  # health, or an error pending: a body is not kept
        try:
            self.upload.add(chunk)
        except Exception as exc:  # noqa: BLE001 - TooLarge, BodiesFull
            self.fail(exc, early=True)

    def message_complete(self, state: AppState) -> None:
        server = state.server
        if self.pending is not None:
            self.fail(self.pending)
            return
        if self.kind == _LIVE:
            self.reply_json(200, {"live": True})
            return
        if self.kind == _READY:
            self.reply_json(*readiness(server))
            return
        upload = self.upload
        assert upload is not None
        if self.kind == _STREAM:
            self.proto.native_stream = stream = Stream(self)
            stream.open(state, upload.body())
            return
        try:
            shared, restrictions = server.shared_memory, state.restrictions
            regions = (
                shared.for_request(restrictions, header_values(self.proto.headers))
                if restrictions
                else shared.open
            )
            decode = request_decoder(upload.body(), self.header_length, state.limits, regions)
            # The version that answers is the one served now (resolved again).
            queued = core.start(server, self.name, self.version, decode, self.proto.headers)
        except Exception as exc:  # noqa: BLE001 - answered by the error table
            self.fail(exc)
            return
        self.queued = queued
        queued.future.add_done_callback(self.done)

    def done(self, future: asyncio.Future) -> None:
        queued, self.queued = self.queued, None
        if future.cancelled():  # the client hung up (or the server cancelled it)
            self.reply(499, [])
            return
        assert queued is not None
        try:
            parts, header_length = queued.finish(_encode)
        except Exception as exc:  # noqa: BLE001 - answered by the error table
            self.fail(exc)
            return
        if header_length is None:
            self.reply(200, parts, _JSON)
        else:
            extra = b"%s: %d\r\n" % (_LENGTH_HEADER, header_length)
            self.reply(200, parts, _BINARY + extra)

    def lost(self) -> None:
        """The connection closed before the reply."""
        self.disconnected = True
        stream = self.proto.native_stream
        if stream is not None and stream.cycle is self:
            stream.lost()
        if self.queued is not None:
            self.queued.cancel()  # out of the queue if not dispatched; done() releases
        elif self.upload is not None:
            self.upload.release()

    # ------------------------------------------------------------------ replies

    def fail(self, exc: BaseException, early: bool = False) -> None:
        """Answer ``exc`` by the error table; ``early``: before the whole body came,
        so the connection closes after the answer (without a reset: the protocol's
        ``close_answered``)."""
        state = self.proto.native_state
        assert state is not None
        status, doc, headers = error_reply(exc, state.server, f"{self.kind} {self.name!r}")
        extra = b""
        if headers:
            for key, value in headers.items():
                if key.lower() == "connection":
                    self.keep_alive = False
                else:
                    extra += b"%s: %s\r\n" % (key.lower().encode(), value.encode())
        if early:
            self.keep_alive = False
        self.reply_json(status, doc, extra)

    def reply_json(self, status: int, doc: Any, extra: bytes = b"") -> None:
        self.reply(status, [orjson.dumps(doc)], _JSON + extra)

    def head(self, status: int, headers: bytes) -> bytes:
        """A response's status line and headers (``headers``: those of this response)."""
        head = [_STATUS[status]]
        for name, value in self.proto.server_state.default_headers:  # date, server
            head += [name, b": ", value, b"\r\n"]
        head.append(headers)
        if not self.keep_alive:
            head.append(_CLOSE)
        head.append(b"\r\n")
        return b"".join(head)

    def reply(self, status: int, parts: list, headers: bytes = b"") -> None:
        """Write the response (``parts``: the body's buffers), then go on as uvicorn
        does after a response: the next request, or close without keep-alive."""
        if self.response_complete:
            return
        length = sum(map(len, parts))  # bytes, and 1-D uint8 views
        self.complete(
            status, [self.head(status, headers + b"content-length: %d\r\n" % length), *parts]
        )

    def complete(self, status: int, parts: list) -> None:
        """Write the last of the response (``parts``), then go on as uvicorn does after
        a response: the next request, or close without keep-alive."""
        if self.response_complete:
            return
        self.response_complete = True
        if self.upload is not None:
            self.upload.release()
        proto = self.proto
        if proto.native is self:
            proto.native = None
        if proto.native_stream is not None and proto.native_stream.cycle is self:
            proto.native_stream = None
        transport = proto.transport
        if self.disconnected or not proto.can_reply():
            return
        transport.writelines(parts)
        if proto.access_log and proto.access_logger.isEnabledFor(logging.INFO):
            # uvicorn's access formatter takes these five arguments, as its own line
            proto.access_logger.info(
                '%s - "%s %s HTTP/%s" %d', _client(proto), proto.scope.get("method"),
                proto.url.decode("latin-1"), "1.1", status,
            )  # fmt: skip
        if not self.keep_alive:
            proto.close_answered()
        proto.on_response_complete()  # counts it; the next request, or the keep-alive timer
        if proto.flow.write_paused:
            proto.flow.pause_reading()  # a client that does not read: read no more of it


class Stream:
    """A ``generate_stream`` request on the native path, once its body is in: opened
    (``KServeCall.open``, a task: a ``--workers`` worker waits for the device process),
    then written from the generation's listener, one chunk per step (see the module)."""

    __slots__ = ("cycle", "call", "pieces", "task")

    def __init__(self, cycle: NativeCycle) -> None:
        self.cycle = cycle
        self.call: Any = None  # serving.kserve.generation.KServeCall, once open
        self.pieces: Any = None  # serving.kserve.generation.Pieces
        self.task: asyncio.Task | None = None

    def open(self, state: AppState, body: Any) -> None:
        from ..kserve.generation import KServeCall, body_of

        cycle = self.cycle
        params = {"model": cycle.name, "version": cycle.version}
        try:
            doc = body_of(bytes(body))
        except Exception as exc:  # noqa: BLE001 - answered by the error table
            cycle.fail(exc)
            return
        headers = cycle.proto.headers
        self.task = asyncio.ensure_future(KServeCall.open(state.server, params, doc, headers))
        self.task.add_done_callback(self._opened)

    def _opened(self, task: asyncio.Task) -> None:
        from ..kserve.generation import Pieces

        self.task = None
        cycle = self.cycle
        if task.cancelled():
            return  # the client hung up meanwhile
        exc = task.exception()
        if exc is not None:
            cycle.fail(exc)
            return
        call = self.call = task.result()
        if cycle.disconnected or not cycle.proto.can_reply():
            Pieces.close_of(call.prompt, call.gen)  # (cancels it, ends its trace)
            return
        self.pieces = Pieces(call.decoder, call.gen, call.prompt)
        cycle.proto.transport.write(cycle.head(200, _SSE_HEAD))
        call.gen.listen(self._wake)

    def _wake(self, gen: Any) -> None:
        """The generation's news: this step's tokens as one chunk of events, and at
        its end the final event and the end of the response."""
        cycle = self.cycle
        if cycle.response_complete:
            return
        done = gen.finish_reason is not None  # (read first: its tokens are all in then)
        call, pieces = self.call, self.pieces
        events = []
        for token in gen.take():
            events.append(call.event(pieces.piece(token)))
            if pieces.stopped:
                done = True
                break
        if done:
            rest = pieces.rest()
            if rest is not None:
                events.append(call.event(rest))
            events.append(call.last_event())
            pieces.close()
        data = b"".join(events)
        parts = [b"%x\r\n" % len(data), data, b"\r\n"] if data else []
        if done:
            cycle.complete(200, [*parts, b"0\r\n\r\n"])
        elif parts and not cycle.disconnected:
            cycle.proto.transport.writelines(parts)

    def lost(self) -> None:
        """The client hung up: the generation is cancelled (its slot freed)."""
        if self.task is not None:
            self.task.cancel()
        if self.pieces is not None:
            self.pieces.close()


def _encode(
    name: str, model: ServedModel, request: core.InferRequest, outputs: dict
) -> tuple[list, int | None]:
    header, blobs = codec.response_parts(name, model.version, request.id, outputs, request.outputs)
    return [header, *blobs], len(header) if blobs else None


def _client(proto: HttpToolsProtocol) -> str:
    return f"{proto.client[0]}:{proto.client[1]}" if proto.client else "-"


class NativeInferProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the native path (``native_state``: the app's
    ``AppState``; None: every request goes to the ASGI app)."""

    native_state: AppState | None = None
    native: NativeCycle | None = None  # the native request in progress (not yet answered)
    native_stream: Stream | None = None  # a generation it streams (not yet ended)

    def can_reply(self) -> bool:
        """Whether a reply may still be written on this connection."""
        return not self.transport.is_closing()

    def close_answered(self) -> None:
        """Close after a reply that ends the connection (the guard lingers instead)."""
        self.transport.close()

    def on_message_begin(self) -> None:
        # An answer written inside the parser's callbacks (health, an early error) armed
        # uvicorn's keep-alive timer; this request, parsed from the same read, stops it.
        self._unset_keepalive_if_required()
        super().on_message_begin()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.native_state is not None:
            self.flow.resume_reading()  # paused by a native reply while writes were

    def on_headers_complete(self) -> None:
        state = self.native_state
        cycle = self.cycle
        if state is not None and (cycle is None or cycle.response_complete):
            found = route(self.parser.get_method(), self.url)
            if found is not None and not self.parser.should_upgrade():
                self.scope["method"] = self.parser.get_method().decode("ascii")
                native = NativeCycle(self, *found)
                self.cycle = native  # type: ignore[assignment]
                self.native = native
                native.headers_complete(state)
                return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if isinstance(cycle, NativeCycle):
            if not cycle.response_complete:
                cycle.body(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if isinstance(cycle, NativeCycle):
            if not cycle.response_complete:
                assert self.native_state is not None
                cycle.message_complete(self.native_state)
            return
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        native = self.native  # (a request pipelined behind it may be self.cycle)
        if native is not None and not native.response_complete:
            native.lost()
        super().connection_lost(exc)


__all__ = ["NativeCycle", "NativeInferProtocol", "route"]
