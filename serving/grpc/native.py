"""KServe v2 gRPC on pxrt's own HTTP/2 (``serving.grpc.h2``): what ``pxrt serve --grpc-port``
runs unless ``--no-native-grpc``.

grpcio's server costs ~250-300 us of CPU per call before a servicer runs; this one
answers the same service, to the same unmodified clients (``tritonclient.grpc``, sync,
asyncio and streaming; any grpc client), from the HTTP/2 frames themselves:

- ``ModelInfer``: the message is parsed once its last DATA frame is in, the request core
  queues it (``core.start``), and the future's callback writes the answer: response
  headers, the message and the trailers in one write per turn of the event loop (with
  the other answers of the same batch). The response's tensors are written from the
  output arrays' own memory: the message is serialized without ``raw_output_contents``
  and each output follows as its field's tag, length and the array's bytes (protobuf
  concatenates repeated fields, so the bytes on the wire are the same).
- ``ModelStreamInfer``: each message is queued as it arrives and answered as it
  completes, in completion order, each failing alone with its ``id``. At most
  ``GrpcLimits.max_stream_inflight`` requests are unanswered; past that the stream's
  flow-control window is not given back, so the client is held by HTTP/2 itself. When
  the server drains, the stream stops taking requests, answers those it took, and ends
  UNAVAILABLE.
- every other method runs ``GRPCService``'s coroutine (the one grpcio's server runs)
  with a context that speaks the same ``abort``; the shared-memory methods answer
  UNIMPLEMENTED.

The limits are grpcio's where it has them (``GrpcLimits``: connections, handshake, idle
and keepalive timeouts, ping strikes; messages over ``max_message_bytes`` are
RESOURCE_EXHAUSTED) and HTTP's where it has none: the bytes of messages being received
count against the same ``core.BodyBudget`` as HTTP's bodies, and a message that stops
arriving for ``body_timeout_s`` fails its call. Requests compressed with ``gzip`` or
``deflate`` are taken; answers are not compressed. ``grpc-timeout`` is the request's
deadline unless its ``timeout`` parameter says otherwise.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import zlib
from collections import deque
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from ..accept import Acceptor, linger_allowance, listening_socket
from ..access import Restrictions, TlsFiles, header_values
from ..kserve import codec, core
from ..kserve.core import BodyBudget, InferRequest
from ..options import GrpcLimits
from . import h2
from .service import GROUPS, GRPCService, Malformed, _checked, _parser, shm_response

if TYPE_CHECKING:
    from ..engine.repository import Repository
    from ..engine.server import Server
    from ..kserve.backend import Backend, ServedModel
    from ..kserve.shm import Regions


log = logging.getLogger("pxrt.grpc")

SERVICE = "inference.GRPCInferenceService"
_CODES = core.GRPC_CODES
_OK, _CANCELLED, _UNIMPLEMENTED = 0, _CODES["CANCELLED"], _CODES["UNIMPLEMENTED"]
_INTERNAL, _INVALID = _CODES["INTERNAL"], _CODES["INVALID_ARGUMENT"]
_RESOURCE, _DEADLINE = _CODES["RESOURCE_EXHAUSTED"], _CODES["DEADLINE_EXCEEDED"]
_UNAVAILABLE = _CODES["UNAVAILABLE"]

_ACCEPT = (b"grpc-accept-encoding", b"identity,deflate,gzip")
_HEADERS = h2.encode_headers(
    [(b":status", b"200"), (b"content-type", b"application/grpc"), _ACCEPT]
)
_OK_TRAILERS = h2.encode_headers([(b"grpc-status", b"0")])
_PREFIX = struct.Struct(">BI")  # a gRPC message's compressed flag and length
_TIMEOUT_UNITS = {72: 3600.0, 77: 60.0, 83: 1.0, 109: 1e-3, 117: 1e-6, 110: 1e-9}  # HMSmun
_MESSAGE_CHARS = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)  # all but '%'
MESSAGE_LIMIT = 2000  # characters of an error message sent in grpc-message

# Methods answered here rather than through GRPCService's coroutines.
_INFER, _STREAM = "ModelInfer", "ModelStreamInfer"


def trailers(code: int, message: str = "", only: bool = False) -> bytes:
    """The trailers of a call that ends with ``code`` (``only``: a Trailers-Only answer,
    with the response headers too, for a call that sent nothing else)."""
    fields = [(b":status", b"200"), (b"content-type", b"application/grpc")] if only else []
    fields.append((b"grpc-status", b"%d" % code))
    if message:
        text = quote(message[:MESSAGE_LIMIT], safe=_MESSAGE_CHARS)  # gRPC's percent-encoding
        fields.append((b"grpc-message", text.encode("ascii")))
    return h2.encode_headers(fields)


def _timeout(value: bytes) -> float | None:
    """``grpc-timeout`` in seconds (None if it is not one)."""
    unit = _TIMEOUT_UNITS.get(value[-1]) if value else None
    digits = value[:-1]
    if unit is None or not 1 <= len(digits) <= 8 or not digits.isdigit():
        return None
    return int(digits) * unit


def _bad_timeout(value: bytes) -> str:
    shown = value[:40].decode("latin-1")
    return f"grpc-timeout {shown!r} is not a timeout: 1 to 8 digits, then H, M, S, m, u or n"


def infer_response_parts(
    name: str, version: str, request_id: str | None, outputs: dict, selected: list
) -> list[Any]:
    """A ModelInferResponse as buffers: the message without its raw contents, then each
    output's ``raw_output_contents`` field (tag, length, the array's own bytes). The
    first part is made once per answer layout (names, dtypes, shapes, id) and kept. An
    output asked for in shared memory is written there (``service.shm_response``)."""
    if not codec.inline(selected):
        return [shm_response(name, version, request_id, outputs, selected).SerializeToString()]
    arrays = [np.ascontiguousarray(outputs[out_name]) for out_name, _ in selected]
    key = (name, version, request_id, *[(a.dtype, a.shape) for a in arrays], *selected)
    head = _HEADS.get(key)
    if head is None:
        response = pb.ModelInferResponse(model_name=name, model_version=version, id=request_id)
        for (out_name, _), arr in zip(selected, arrays):
            response.outputs.add(
                name=out_name, datatype=codec.datatype_of(arr.dtype), shape=arr.shape
            )
        head = response.SerializeToString()
        if len(_HEADS) >= HEADS_KEPT:
            _HEADS.clear()
        _HEADS[key] = head
    parts: list[Any] = [head]
    for arr in arrays:
        parts += [
            b"\x32" + codec.encode_varint(arr.nbytes),
            memoryview(arr.reshape(-1).view(np.uint8).data),
        ]
    return parts


HEADS_KEPT = 256  # response descriptions remembered (by layout; different ids each add one)
_HEADS: dict[tuple, bytes] = {}


def _encode(name: str, model: ServedModel, request: InferRequest, outputs: dict) -> list[Any]:
    return infer_response_parts(name, model.version, request.id, outputs, request.outputs)


def _stream_error(message: Any, text: str) -> bytes:
    """A stream's answer to a request that failed: its error, its model and id."""
    return pb.ModelStreamInferResponse(
        error_message=text,
        infer_response=pb.ModelInferResponse(model_name=message.model_name, id=message.id),
    ).SerializeToString()


class Abort(Exception):
    """What ``Context.abort`` raises: the call ends with ``code`` and ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Context:
    """What ``GRPCService``'s coroutines read of a call (as of grpc.aio's context)."""

    __slots__ = ("address", "code", "details", "headers", "remaining")

    def __init__(self, headers: list, remaining: float | None, address: str = "") -> None:
        self.headers = headers
        self.remaining = remaining
        self.address = address
        self.code: Any = None
        self.details = ""

    def peer(self) -> str:
        """The client's address as grpcio says it (``ipv4:127.0.0.1:port``...)."""
        return self.address

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in self.headers
            if not k.startswith(b":")
        ]

    def time_remaining(self) -> float | None:
        return self.remaining

    async def abort(self, code: Any, details: str) -> None:
        raise Abort(code.value[0], details)

    def set_code(self, code: Any) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class Method:
    """A method of the service: its name, how its request parses, its response
    serializes, and (for those not answered natively) its coroutine."""

    __slots__ = ("group", "impl", "name", "parse", "serialize")

    def __init__(self, name: str, parse: Any, serialize: Any, impl: Any, group: str | None):
        self.name = name
        self.parse = parse
        self.serialize = serialize
        self.impl = impl
        self.group = group


def methods(service: GRPCService | None) -> dict[bytes, Method]:
    """``:path`` -> the method, for every method of the service (those other than
    inference run ``service``'s coroutines; without it, a worker forwards them)."""
    descriptor = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    table = {}
    for m in descriptor.methods:
        group = GROUPS.get(m.name)
        impl = None
        if service is not None and m.name not in (_INFER, _STREAM):
            impl = _checked(getattr(service, m.name), group, service.restrictions)
        table[f"/{SERVICE}/{m.name}".encode()] = Method(
            m.name,
            _parser(getattr(pb, m.input_type.name)),
            getattr(pb, m.output_type.name).SerializeToString,
            impl,
            group,
        )
    return table


async def run_method(
    method: Method, data: bytes, headers: list, remaining: float | None, peer: str = ""
) -> tuple[int, str, bytes]:
    """Run a method that ``GRPCService`` answers (not inference): its status code, its
    message, and its response message serialized (when the code is OK). ``peer``: the
    client's address, as grpcio's ``context.peer()`` ("": not known)."""
    context = Context(headers, remaining, peer)
    try:
        response = await method.impl(method.parse(data), context)
    except Abort as exc:
        return exc.code, exc.message, b""
    except NotImplementedError:
        code = context.code.value[0] if context.code is not None else _UNIMPLEMENTED
        return code, context.details or "Method not implemented!", b""
    except Exception as exc:  # noqa: BLE001 - a bug: one line, INTERNAL
        status = core.answer(exc, method.name)
        return _CODES[status.grpc], status.message, b""
    return _OK, "", method.serialize(response)


def _peer(transport: Any) -> str:
    """A connection's client address, as grpcio writes it (``Context.peer``)."""
    address = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
    if isinstance(address, str):  # (a Unix socket's path)
        return f"unix:{address}"
    return ""


# --------------------------------------------------------------------------- calls


_NO_FUTURES: set = frozenset()  # type: ignore[assignment]
_NO_MESSAGES: deque = deque(maxlen=0)
_EMPTY = bytearray()  # (never appended to: a call makes its own buffer)
SMALL_MESSAGE = 4096  # a whole message under this in a larger received chunk is copied


class Call(h2.Stream):
    """One gRPC call: an HTTP/2 stream and what it has received and is owed."""

    __slots__ = (
        "backlog",
        "buffer",
        "deadline",
        "draining",
        "encoding",
        "headers",
        "headers_sent",
        "inflight",
        "last_data",
        "message",
        "method",
        "queued",
        "pumping",
        "requests",
        "taken",
        "task",
    )

    def __init__(self, stream_id: int, recv_window: int) -> None:
        super().__init__(stream_id, recv_window)
        self.method: Method | None = None
        self.headers: list = []
        self.deadline: float | None = None  # loop time
        self.encoding = b""
        self.buffer = _EMPTY  # received bytes not yet a whole message
        self.taken = 0  # bytes of the budget this call holds
        self.last_data = 0.0  # when it last received part of its request
        self.message: Any = None  # a unary call's request message (bytes-like)
        self.headers_sent = False
        self.queued: core.Pending | None = None  # a unary call's request, once queued
        self.task: asyncio.Task | None = None
        # streams
        self.inflight = 0  # requests taken and not yet answered
        # A stream's requests in flight (futures, generation tasks): a set of its own once
        # a stream.
        self.requests: set[asyncio.Future] = _NO_FUTURES
        self.backlog: deque = _NO_MESSAGES  # (data, bytes held): a deque of its own if a stream
        self.draining = False
        self.pumping = False


class GrpcProtocol(h2.H2Protocol[Call]):
    """One gRPC connection (``GrpcServer`` makes them)."""

    def __init__(self, owner: GrpcServer) -> None:
        super().__init__(owner.connections, Call)
        self.owner = owner
        self.server = owner.server
        self.budget = owner.budget
        self.max_message = owner.max_message_bytes
        self.max_inflight = owner.limits.max_stream_inflight
        # Calls waiting for the rest of their request (a unary call until its END_STREAM,
        # a stream while a message is part-way in): the sweep fails those that stall.
        self._waiting: set[Call] = set()
        # ModelStreamInfer calls open: the sweep ends those idle for too long.
        self._stream_calls: set[Call] = set()

    # ------------------------------------------------------------------ streams in

    def open_stream(self, call: Call, headers: list) -> None:
        call.headers = headers
        call.last_data = self.last_frame
        path = content_type = timeout = None
        method = b""
        bad_timeout: bytes | None = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = _timeout(value)
                if timeout is None:
                    bad_timeout = value
            elif name == b"grpc-encoding":
                call.encoding = value
        if method != b"POST":
            self._http_error(call, b"405")
            return
        if content_type is None or not content_type.startswith(b"application/grpc"):
            self._http_error(call, b"415")
            return
        spec = self.owner.methods.get(path) if path is not None else None
        if spec is None:
            where = (path or b"").decode("latin-1")[:200]
            self.finish(call, _UNIMPLEMENTED, f"Method not found: {where}")
            return
        call.method = spec
        if call.encoding not in (b"", b"identity", b"gzip", b"deflate"):
            self.finish(call, _UNIMPLEMENTED, f"grpc-encoding {call.encoding!r} is not supported")
            return
        if bad_timeout is not None:
            self.finish(call, _INVALID, _bad_timeout(bad_timeout))
            return
        if timeout is not None:
            call.deadline = self.loop.time() + timeout
        if spec.impl is None and self.owner.restrictions:  # ModelInfer, ModelStreamInfer
            try:
                self.owner.restrictions.check(spec.group or "", header_values(headers))
            except Exception as exc:  # noqa: BLE001 - Forbidden, KeyRepeated
                self.fail_call(call, exc)
                return
        if spec.name == _STREAM:
            call.requests = set()
            call.backlog = deque()
            self._stream_calls.add(call)
            self.send_headers(call, _HEADERS)  # a stream answers as it goes
            call.headers_sent = True
            if self.server.draining:
                self._drain_call(call)
        elif not call.remote_closed:
            self._waiting.add(call)
        if call.remote_closed:
            self._ended(call)

    def _http_error(self, call: Call, status: bytes) -> None:
        self.send_headers(call, h2.encode_headers([(b":status", status)]), end_stream=True)

    def stream_data(self, call: Call, data: memoryview, end_stream: bool) -> None:
        if data and not call.ending:
            if not self.budget.take(len(data)):
                self.fail_call(call, self.budget.full())
                return
            call.taken += len(data)
            call.last_data = self.last_frame
            if call.buffer:
                call.buffer += data
                self._split_buffer(call)
            else:
                self._split_frame(call, data)
        if end_stream and not call.ending:
            self._ended(call)

    def _split_frame(self, call: Call, data: memoryview) -> None:
        """The whole messages of a DATA payload (views of it: the common case, a message
        in one frame, copies nothing), and the rest into the call's buffer."""
        pos, end = 0, len(data)
        chunk = len(data.obj)  # type: ignore[arg-type]
        while end - pos >= 5 and not call.ending:
            flag, length = _PREFIX.unpack_from(data, pos)
            if length > self.max_message:
                self._too_large(call, length)
                return
            stop = pos + 5 + length
            if stop > end:
                break
            message: Any = data[pos + 5 : stop]
            if length < SMALL_MESSAGE and chunk > 4 * length + 4096:
                message = bytes(message)  # (a view would keep the whole chunk alive)
            self._message(call, flag, message, 5 + length)
            pos = stop
        if pos < end and not call.ending:
            call.buffer = bytearray(data[pos:])
            self._split_buffer(call)
        elif call.method is not None and call.method.name == _STREAM:
            self._waiting.discard(call)

    def _split_buffer(self, call: Call) -> None:
        """The whole messages in the call's buffer (copies), the rest kept."""
        buffer = call.buffer
        pos, end = 0, len(buffer)
        while end - pos >= 5 and not call.ending:
            flag, length = _PREFIX.unpack_from(buffer, pos)
            if length > self.max_message:
                self._too_large(call, length)
                return
            stop = pos + 5 + length
            if stop > end:
                break
            self._message(call, flag, bytes(buffer[pos + 5 : stop]), 5 + length)
            pos = stop
        if call.ending:
            return
        if pos:
            del buffer[:pos]
        if not buffer:
            call.buffer = _EMPTY
        if buffer or (call.method is not None and call.method.name != _STREAM):
            self._waiting.add(call)
        else:
            self._waiting.discard(call)

    def _too_large(self, call: Call, length: int) -> None:
        self.finish(
            call, _RESOURCE, f"Received message larger than max ({length} vs. {self.max_message})"
        )

    def _message(self, call: Call, flag: int, data: Any, held: int) -> None:
        """One whole message of ``call`` (``held``: what it holds of the budget, its
        bytes on the wire: a stream gives them back once it is answered)."""
        if flag > 1:
            self.finish(call, _INVALID, f"a message's compressed flag is 0 or 1, got {flag}")
            return
        if flag:
            inflated = self._decompress(call, data)
            if inflated is None:
                return
            if not self.budget.take(len(inflated)):
                self.fail_call(call, self.budget.full())
                return
            call.taken += len(inflated)
            data, held = inflated, held + len(inflated)
        method = call.method
        assert method is not None
        if method.name == _STREAM:
            if call.draining:
                self._give(call, held)
                return  # not taken: the client is told UNAVAILABLE at the end
            if call.backlog or call.out or call.inflight >= self.max_inflight:
                call.backlog.append((data, held))
                call.held = True  # its window is given back as answers go out
                return
            self._stream_request(call, data, held)
            return
        if call.message is not None:
            self.finish(call, _INVALID, f"{method.name} takes one request message, got more")
            return
        call.message = data

    def _decompress(self, call: Call, data: Any) -> bytes | None:
        if call.encoding in (b"", b"identity"):
            self.finish(call, _INTERNAL, "a compressed message without a grpc-encoding")
            return None
        wbits = 16 + zlib.MAX_WBITS if call.encoding == b"gzip" else zlib.MAX_WBITS
        inflater = zlib.decompressobj(wbits)
        what = call.encoding.decode()
        try:
            out = inflater.decompress(data, self.max_message + 1)
        except zlib.error as exc:
            self.finish(call, _INTERNAL, f"a {what} message that does not inflate: {exc}")
            return None
        if len(out) > self.max_message:
            self._too_large(call, len(out))
            return None
        if not inflater.eof or inflater.unused_data:
            self.finish(call, _INTERNAL, f"a {what} message that is cut short or runs on")
            return None
        return out

    def _ended(self, call: Call) -> None:
        """The client sent all it will send on ``call``."""
        self._waiting.discard(call)
        if call.ending:
            return
        if call.buffer:
            self.finish(call, _INTERNAL, "the call ended inside a message")
            return
        method = call.method
        assert method is not None
        if method.name == _STREAM:
            self._stream_maybe_done(call)
            return
        if call.message is None:
            self.finish(call, _INVALID, f"{method.name} needs a request message")
            return
        remaining = None
        if call.deadline is not None:
            remaining = call.deadline - self.loop.time()
            if remaining <= 0:
                self.finish(call, _DEADLINE, "the deadline passed before the request was in")
                return
        if method.name == _INFER:
            self._infer(call, remaining)
        else:
            call.task = asyncio.ensure_future(self._unary(call, method, remaining))

    # ------------------------------------------------------------------ ModelInfer

    def _infer(self, call: Call, remaining: float | None) -> None:
        data, call.message = call.message, None
        try:
            name, version, decode = _decoder(data, remaining, self._regions(call))
            queued = core.start(self.server, name, version or None, decode, call.headers)
        except Exception as exc:  # noqa: BLE001 - answered by the error table
            self.fail_call(call, _malformed_first(exc, data))
            return
        call.queued = queued
        queued.future.add_done_callback(functools.partial(self._infer_done, call, queued))

    def _regions(self, call: Call) -> Regions:
        """The system shared memory ``call``'s requests may name."""
        restrictions, shared = self.owner.restrictions, self.server.shared_memory
        if not restrictions:
            return shared.open
        return shared.for_request(restrictions, header_values(call.headers))

    def _infer_done(self, call: Call, queued: core.Pending, future: asyncio.Future) -> None:
        call.queued = None
        if call.ending:  # reset by the client meanwhile
            return
        if future.cancelled():
            self.finish(call, _CANCELLED, "the request was cancelled")
            return
        try:
            message = queued.finish(_encode)
        except Exception as exc:  # noqa: BLE001 - answered by the error table
            self.fail_call(call, exc)
            return
        self.respond(call, message)

    # ------------------------------------------------------------------ ModelStreamInfer

    def _stream_request(self, call: Call, data: Any, held: int) -> None:
        """Take one request of a stream: queued, or answered at once with its error. A
        request to a decoder generates (``serving.kserve.generation_grpc``)."""
        try:
            name, version, decode = _decoder(data, None, self._regions(call))
            if self.server.is_decoder(name):
                self._generate(call, data, held)
                return
            queued = core.start(self.server, name, version or None, decode, call.headers)
        except Exception as exc:  # noqa: BLE001 - this request's answer
            error = _malformed_first(exc, data)
            self._stream_send(
                call,
                [_stream_error(_parsed(data), core.answer(error, "gRPC inference").message)],
                held,
            )
            return
        call.inflight += 1
        call.requests.add(queued.future)
        queued.future.add_done_callback(
            functools.partial(self._stream_done, call, data, queued, held)
        )

    def _stream_done(
        self, call: Call, data: Any, queued: core.Pending, held: int, future: asyncio.Future
    ) -> None:
        call.inflight -= 1
        call.requests.discard(future)
        if call.ending:
            return
        if future.cancelled():
            # the request was cancelled, not the stream (its model closing): answered
            # like any failed one, or the stream would wait for it forever
            parts = [_stream_error(_parsed(data), "the request was cancelled")]
        else:
            try:
                inner = queued.finish(_encode)
            except Exception as exc:  # noqa: BLE001 - this request's answer
                parts = [_stream_error(_parsed(data), core.answer(exc, "gRPC inference").message)]
            else:
                parts = [b"\x12" + codec.encode_varint(sum(map(len, inner))), *inner]
        self._stream_send(call, parts, held)
        self._pump(call)

    def _generate(self, call: Call, data: Any, held: int) -> None:
        call.inflight += 1
        task = self.loop.create_task(self._generation(call, data, held))
        call.requests.add(task)

    async def _generation(self, call: Call, data: Any, held: int) -> None:
        """One decoupled request: a response per token, then the final one (or its
        error). The stream's reset cancels it, and with it the generation."""
        from ..kserve.generation_grpc import responses

        try:
            async for response in responses(self.server, _parse(data), call.headers):
                if call.ending:
                    return
                payload = response.SerializeToString()
                self.send_data(call, [_PREFIX.pack(0, len(payload)), payload])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - this request's answer
            if not call.ending:
                error = _stream_error(
                    _parsed(data),
                    core.answer(_malformed_first(exc, data), "gRPC generation").message,
                )
                self.send_data(call, [_PREFIX.pack(0, len(error)), error])
        finally:
            call.inflight -= 1
            call.last_data = self.loop.time()
            task = asyncio.current_task()
            if task is not None:
                call.requests.discard(task)
            self._give(call, held)
            if not call.ending:
                self._pump(call)

    def _stream_send(self, call: Call, parts: list, held: int) -> None:
        """Write one answer of a stream (a ModelStreamInferResponse's buffers) and give
        back what its request held."""
        length = sum(map(len, parts))
        call.last_data = self.loop.time()  # (a stream answering is not idle)
        self.send_data(call, [_PREFIX.pack(0, length), *parts])
        self._give(call, held)

    def _pump(self, call: Call) -> None:
        """Take what waited for room: requests until the cap, while the answers written
        go out (answers still waiting for the client's window count as not answered:
        the client is held by flow control, not buffered)."""
        if call.pumping:
            return  # (an answer written below drained the queue: the loop goes on)
        call.pumping = True
        try:
            backlog = call.backlog
            while (
                backlog
                and not call.out
                and call.inflight < self.max_inflight
                and not (call.draining or call.ending)
            ):
                self._stream_request(call, *backlog.popleft())
            if not backlog and not call.out and call.held and not call.ending:
                call.last_data = self.loop.time()  # (it could not send while held)
                self.release(call)
        finally:
            call.pumping = False
        self._stream_maybe_done(call)

    def stream_drained(self, call: Call) -> None:
        if call.method is not None and call.method.name == _STREAM:
            self._pump(call)

    def _stream_maybe_done(self, call: Call) -> None:
        if call.ending or call.inflight:
            return
        if call.draining:
            self.finish(call, _UNAVAILABLE, self.server.not_serving() or "the server is draining")
        elif call.remote_closed and not call.backlog:
            self.finish(call, _OK)

    def drain_streams(self) -> None:
        """The server drains: every stream stops taking requests (see the module)."""
        for call in list(self.streams.values()):
            if call.method is not None and call.method.name == _STREAM:
                self._drain_call(call)

    def _drain_call(self, call: Call) -> None:
        call.draining = True
        for _, held in call.backlog:
            self._give(call, held)
        call.backlog.clear()
        self._stream_maybe_done(call)

    # ------------------------------------------------------------------ other methods

    async def _unary(self, call: Call, method: Method, remaining: float | None) -> None:
        data, call.message = call.message, None
        if self.owner.forward is not None:  # (a worker: the device process answers)
            code, message, body = await self.owner.forward(
                method, bytes(data), call.headers, remaining
            )
        else:
            code, message, body = await run_method(
                method, bytes(data), call.headers, remaining, _peer(self.transport)
            )
        if code == _OK:
            self.respond(call, [body])
        else:
            self.finish(call, code, message)

    # ------------------------------------------------------------------ answers

    def respond(self, call: Call, parts: list) -> None:
        """Answer a unary call with one message (``parts``: its buffers)."""
        if call.ending:
            return
        length = sum(map(len, parts))
        self._release(call)
        call.headers_sent = True
        self.send_response(call, _HEADERS, [_PREFIX.pack(0, length), *parts], _OK_TRAILERS)

    def fail_call(self, call: Call, exc: BaseException) -> None:
        """End ``call`` with ``exc``'s status (the request core's error table)."""
        status = core.answer(exc, "gRPC inference")
        self.finish(call, _CODES[status.grpc], status.message)

    def finish(self, call: Call, code: int, message: str = "") -> None:
        """End ``call`` with its trailers (and give back what it holds); nothing is sent
        on it after them."""
        if call.ending:
            return
        if code == _OK and call.headers_sent:
            block = _OK_TRAILERS
        else:
            block = trailers(code, message, only=not call.headers_sent)
        self._release(call)
        self.send_headers(call, block, end_stream=True)

    def _give(self, call: Call, n: int) -> None:
        self.budget.give(n)
        call.taken -= n

    def _release(self, call: Call) -> None:
        self._stream_calls.discard(call)
        if call.taken:
            self.budget.give(call.taken)
            call.taken = 0
        call.buffer = _EMPTY
        call.message = None
        if call.backlog:
            call.backlog.clear()
        self._waiting.discard(call)

    def stream_reset(self, call: Call, code: int) -> None:
        self._release(call)
        if call.queued is not None:
            call.queued.cancel()  # out of the queue if it was not dispatched
            call.queued = None
        for future in list(call.requests):
            future.cancel()
        if call.task is not None:
            call.task.cancel()
            call.task = None

    def sweep_streams(self, now: float) -> None:
        body_s = self.connections.body_timeout_s
        for call in [c for c in self._waiting if c.last_data < now - body_s and not c.held]:
            self.finish(call, _DEADLINE, f"the client sent no part of its request for {body_s:g} s")
        idle_s = self.owner.limits.stream_idle_timeout_s
        for call in [c for c in self._stream_calls if c.last_data < now - idle_s]:
            if not (call.inflight or call.backlog or call.out or call.ending):
                self.finish(call, _UNAVAILABLE, f"the stream was idle for {idle_s:g} s")

    def overflow(self, call: Call) -> None:
        self.finish(
            call,
            _RESOURCE,
            f"the client has not read {self.queued_bytes} bytes of answers on this "
            "connection: no more are queued for it",
        )


_MALFORMED = Malformed("ModelInferRequest")


def _parse(data: Any) -> Any:
    try:
        return pb.ModelInferRequest.FromString(data)
    except DecodeError:
        raise codec.ProtocolError(_MALFORMED.error) from None


def _parsed(data: Any) -> Any:
    """The message of ``data``, or ``Malformed`` (for a stream's error answer)."""
    try:
        return pb.ModelInferRequest.FromString(data)
    except DecodeError:
        return _MALFORMED


def _malformed_first(exc: BaseException, data: Any) -> BaseException:
    """The error a request fails with: a message that is not a valid protobuf is that,
    whatever else went wrong (its model name, read off its first bytes, is no model)."""
    if isinstance(exc, codec.ProtocolError):
        return exc
    try:
        _parse(data)
    except codec.ProtocolError as malformed:
        return malformed
    return exc


def _decoder(data: Any, deadline_s: float | None, regions: Regions) -> tuple[str, str, Any]:
    """The model name and version a serialized ModelInferRequest asks for, and the
    ``decode`` of the request core for it: from its bytes, where the name comes first
    (``InferRequest.from_proto_bytes``), else from the parsed message."""
    names = codec.proto_model(data)
    if names is not None:
        name, version = names

        def parse(data: Any) -> Any:
            message = _parse(data)
            if (message.model_name, message.model_version) != (name, version):
                # protobuf keeps a field's last value: one named twice names its last
                raise codec.ProtocolError("the request names its model more than once")
            return message

        def decode(model: ServedModel) -> InferRequest:
            return InferRequest.from_proto_bytes(data, model, parse, deadline_s, regions)

        return name, version, decode
    message = _parse(data)

    def decode_message(model: ServedModel) -> InferRequest:
        return InferRequest.from_proto(message, model, deadline_s, regions)

    return message.model_name, message.model_version, decode_message


# --------------------------------------------------------------------------- server


class GrpcServer:
    """``GRPCInferenceService`` on pxrt's HTTP/2 (``start``, then ``stop``, as grpcio's
    server): inference over ``backend``; every other method answered by ``control``
    (the ``Server``, with its ``repository``), or, in a ``--workers`` worker, by the
    device process: ``forward(method, data, headers, remaining)`` as ``run_method``."""

    def __init__(
        self,
        backend: Backend,
        *,
        max_message_bytes: int,
        control: Server | None = None,
        repository: Repository | None = None,
        forward: Any = None,
        limits: GrpcLimits = GrpcLimits(),
        restrictions: Restrictions = Restrictions(),
        budget: BodyBudget | None = None,
        body_timeout_s: float = 10.0,
        settings: h2.Settings = h2.Settings(),
    ) -> None:
        if (control is None) == (forward is None):
            raise ValueError("GrpcServer: give control (a Server) or forward, not both")
        self.server = backend
        self.forward = forward
        self.limits = limits
        self.restrictions = restrictions
        self.max_message_bytes = max_message_bytes
        self.budget = budget if budget is not None else BodyBudget(8 * max_message_bytes)
        service = None
        if control is not None:
            service = GRPCService(control, repository, limits, restrictions)
        self.methods = methods(service)
        self.connections = h2.Connections(
            settings,
            max_connections=limits.max_connections,
            handshake_timeout_s=limits.handshake_timeout_s,
            idle_timeout_s=limits.idle_timeout_s,
            keepalive_s=limits.keepalive_s,
            keepalive_timeout_s=limits.keepalive_timeout_s,
            min_client_ping_s=limits.min_client_ping_s,
            body_timeout_s=body_timeout_s,
            max_control_frames=limits.max_control_frames,
            max_queued_bytes=limits.max_queued_bytes,
            send_timeout_s=limits.send_timeout_s,
            max_streams=limits.max_streams,
        )
        self._acceptor: Acceptor | None = None
        self._owns_socket = False
        self._drain_watch: asyncio.Future | None = None

    async def start(
        self, host: str, port: int, tls: TlsFiles | None = None, sock: Any = None
    ) -> None:
        """Listen on ``host:port``, or on ``sock`` (a listening socket a worker shares
        with the others: it takes one connection at a time). Connections count from
        their accept (``serving.accept``), TLS handshakes within the handshake timeout."""
        context = tls.server_context(alpn=["h2"]) if tls is not None else None
        shared = sock is not None
        self._owns_socket = not shared
        if sock is None:
            try:
                sock = listening_socket(host, port)
            except OSError as exc:
                raise OSError(f"cannot listen for gRPC on {host}:{port}: {exc}") from None
        conns = self.connections
        self._acceptor = Acceptor(
            sock,
            lambda: GrpcProtocol(self),
            context,
            handshake_timeout_s=self.limits.handshake_timeout_s,
            # Beyond the cap a few more are taken, to be told why (GOAWAY) and closed.
            room=lambda: (
                conns.max_connections + linger_allowance(conns.max_connections) - len(conns.open)
            ),
            burst=1 if shared else 64,
            kind="gRPC",
        )
        self._drain_watch = asyncio.ensure_future(self._watch_drain())

    @property
    def port(self) -> int:
        """The port it listens on."""
        assert self._acceptor is not None
        return self._acceptor.sock.getsockname()[1]

    async def _watch_drain(self) -> None:
        await self.server.wait_draining()
        for conn in list(self.connections.open):
            assert isinstance(conn, GrpcProtocol)
            conn.drain_streams()

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening; calls in progress finish within ``grace`` seconds (GOAWAY
        tells clients to send new ones elsewhere), then every connection closes."""
        if self._acceptor is not None:
            self._acceptor.close()
            if self._owns_socket:
                self._acceptor.sock.close()
        self.connections.drain()
        deadline = asyncio.get_running_loop().time() + (grace or 0)
        while self.connections.open and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        self.connections.close()
        if self._drain_watch is not None:
            self._drain_watch.cancel()


async def start_grpc(
    server: Server,
    port: int,
    *,
    host: str = "127.0.0.1",
    max_message_bytes: int,
    repository: Repository | None = None,
    limits: GrpcLimits = GrpcLimits(),
    restrictions: Restrictions = Restrictions(),
    tls: TlsFiles | None = None,
    budget: BodyBudget | None = None,
    body_timeout_s: float = 10.0,
    sock: Any = None,
) -> GrpcServer:
    """Serve ``GRPCInferenceService`` for ``server`` on ``host:port`` on the running
    loop (as ``serving.grpc.service.start_grpc`` does with grpcio); returns the started
    server."""
    grpc_server = GrpcServer(
        server,
        max_message_bytes=max_message_bytes,
        control=server,
        repository=repository,
        limits=limits,
        restrictions=restrictions,
        budget=budget,
        body_timeout_s=body_timeout_s,
    )
    await grpc_server.start(host, port, tls, sock=sock)
    return grpc_server


__all__ = [
    "GrpcProtocol",
    "GrpcServer",
    "Method",
    "infer_response_parts",
    "methods",
    "run_method",
    "start_grpc",
    "trailers",
]
