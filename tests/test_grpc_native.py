"""gRPC on pxrt's own HTTP/2 (serving.grpc.native, serving.grpc.h2) driven frame by frame with
the ``h2`` package as the client: what grpc clients do (calls, streams, flow control,
compression, deadlines, resets) and what they never do but attackers and broken peers
might (protocol violations, floods, stalls), on a server running on the test's loop.
The unmodified Triton clients drive the same server in test_grpc.py."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import sys
from urllib.parse import unquote

import pytest

if "kserve" in sys.modules:  # its protobufs claim the same names as tritonclient.grpc's
    pytest.skip("kserve is imported in this process", allow_module_level=True)

import numpy as np
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    PingAckReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import assert_matches, inject, reference, until
from tritonclient.grpc import service_pb2 as pb

from serving import Server
from serving.grpc import h2
from serving.grpc.native import GrpcProtocol, GrpcServer
from serving.grpc.service import GrpcLimits
from serving.kserve.core import BodyBudget

PATH = "/inference.GRPCInferenceService/"


def infer_message(x: np.ndarray, model: str = "mlp", rid: str = "") -> bytes:
    request = pb.ModelInferRequest(model_name=model, id=rid)
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


def framed(message: bytes, compressed: bool = False) -> bytes:
    return bytes([compressed]) + len(message).to_bytes(4, "big") + message


def messages(data: bytes) -> list[bytes]:
    out = []
    while data:
        n = int.from_bytes(data[1:5], "big")
        out.append(data[5 : 5 + n])
        data = data[5 + n :]
    return out


def y_of(message: bytes) -> np.ndarray:
    response = pb.ModelInferResponse.FromString(message)
    shape = list(response.outputs[0].shape)
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(shape)


class Answer:
    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.data = b""
        self.trailers: dict[bytes, bytes] = {}
        self.reset: int | None = None
        self.ended = False

    @property
    def status(self) -> int:
        return int((self.trailers or self.headers).get(b"grpc-status", b"-1"))

    @property
    def message(self) -> str:
        return unquote((self.trailers or self.headers).get(b"grpc-message", b"").decode())

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None


class Client:
    """A raw HTTP/2 client over a socket: the ``h2`` package's state machine, or raw
    frames where a test sends what that state machine would not."""

    def __init__(self, reader, writer, auto_ack: bool = True) -> None:
        self.reader, self.writer = reader, writer
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self.auto_ack = auto_ack
        self.answers: dict[int, Answer] = {}
        self.goaway: ConnectionTerminated | None = None
        self.pings: list[bytes] = []
        self.closed = False
        self.received = 0

    @classmethod
    async def connect(cls, port: int, **kw) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer, **kw)
        client.conn.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())
        await self.writer.drain()

    async def raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read_until(self, condition, timeout_s: float = 30.0) -> None:
        async def loop():
            while not condition():
                data = await self.reader.read(1 << 16)
                if not data:
                    self.closed = True
                    return
                self.received += len(data)
                for event in self.conn.receive_data(data):
                    self._event(event)
                await self.flush()

        await asyncio.wait_for(loop(), timeout_s)

    def _event(self, event) -> None:
        sid = getattr(event, "stream_id", None)
        answer = self.answers.setdefault(sid, Answer()) if sid else None
        if isinstance(event, ResponseReceived):
            answer.headers = dict(event.headers)
        elif isinstance(event, DataReceived):
            answer.data += event.data
            if self.auto_ack:
                self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
        elif isinstance(event, TrailersReceived):
            answer.trailers = dict(event.headers)
        elif isinstance(event, StreamEnded):
            answer.ended = True
        elif isinstance(event, StreamReset):
            answer.reset = event.error_code
        elif isinstance(event, ConnectionTerminated):
            self.goaway = event
        elif isinstance(event, PingAckReceived):
            self.pings.append(event.ping_data)

    def open(self, method: str, headers=(), end: bool = False) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            sid,
            [(b":method", b"POST"), (b":scheme", b"http"), (b":path", (PATH + method).encode()),
             (b":authority", b"localhost"), (b"te", b"trailers"),
             (b"content-type", b"application/grpc"), *headers],
            end_stream=end,
        )  # fmt: skip
        self.answers[sid] = Answer()
        return sid

    async def send(self, sid: int, data: bytes, end: bool = False) -> None:
        """DATA within the server's windows and frame size, waiting for it to open them."""
        while True:
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            chunk, data = data[:room], data[room:]
            self.conn.send_data(sid, chunk, end_stream=end and not data)
            await self.flush()
            if not data:
                return
            await self.read_until(lambda: self.conn.local_flow_control_window(sid) > 0)

    async def call(self, method: str, message: bytes, headers=(), timeout_s=30.0) -> Answer:
        sid = self.open(method, headers)
        await self.send(sid, framed(message), end=True)
        await self.read_until(lambda: self.answers[sid].done or self.closed, timeout_s)
        return self.answers[sid]

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


async def serve(server: Server, **kw) -> tuple[GrpcServer, int]:
    max_message_bytes = kw.pop("max_message_bytes", 1 << 22)
    grpc_server = GrpcServer(server, max_message_bytes=max_message_bytes, control=server, **kw)
    await grpc_server.start("127.0.0.1", 0)
    return grpc_server, grpc_server.port


def test_unary_calls_and_big_answers_through_flow_control(models, run):
    """Inference matches JAX, from one row to answers larger than the client's window
    (the server waits for WINDOW_UPDATE) and requests larger than the server's stream
    window (it gives the window back as it reads); metadata calls answer too."""

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server, settings=h2.Settings(initial_window=1 << 16))
            client = await Client.connect(port)
            rng = np.random.default_rng(0)
            for rows in (1, 3, 700, 3000):  # 3000 rows: 384 KB each way
                x = rng.standard_normal((rows, 32)).astype(np.float32)
                answer = await client.call("ModelInfer", infer_message(x, rid=f"r{rows}"))
                assert answer.status == 0, answer.message
                assert answer.headers[b":status"] == b"200"
                (message,) = messages(answer.data)
                assert pb.ModelInferResponse.FromString(message).id == f"r{rows}"
                assert_matches({"y": y_of(message)}, reference("mlp", {"x": x}), str(rows))
            live = await client.call("ServerLive", pb.ServerLiveRequest().SerializeToString())
            assert pb.ServerLiveResponse.FromString(messages(live.data)[0]).live
            meta = await client.call(
                "ModelMetadata", pb.ModelMetadataRequest(name="mlp").SerializeToString()
            )
            assert pb.ModelMetadataResponse.FromString(messages(meta.data)[0]).name == "mlp"
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_errors_are_grpc_statuses(models, run):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server, max_message_bytes=10_000)
            client = await Client.connect(port)
            x = np.ones((1, 32), np.float32)
            cases = [
                ("ModelInfer", infer_message(x, model="nope"), 5, "no model named 'nope'"),
                ("ModelInfer", b"\xff\xff\xff", 3, "not a valid protobuf"),
                ("ModelInfer", infer_message(np.ones((1, 31), np.float32)), 3, "input 'x'"),
                ("ModelInfer", infer_message(np.ones((100, 32), np.float32)), 8,
                 "larger than max (12"),
                ("Nope", b"", 12, "Method not found: /inference.GRPCInferenceService/Nope"),
                ("LogSettings", b"", 12, "Method not implemented"),
                ("RepositoryIndex", b"", 9, "no model repository"),
            ]  # fmt: skip
            for method, message, code, words in cases:
                answer = await client.call(method, message)
                assert (answer.status, words in answer.message) == (code, True), (
                    method, answer.status, answer.message)  # fmt: skip
            # a request still in flight on the same connection is unaffected
            answer = await client.call("ModelInfer", infer_message(x))
            assert answer.status == 0
            # HTTP-level refusals: not POST, not application/grpc
            sid = client.conn.get_next_available_stream_id()
            client.conn.send_headers(
                sid, [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/x"),
                      (b":authority", b"h")], end_stream=True)  # fmt: skip
            sid2 = client.conn.get_next_available_stream_id()
            client.conn.send_headers(
                sid2, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/x"),
                       (b":authority", b"h"), (b"content-type", b"text/plain")],
                end_stream=True)  # fmt: skip
            await client.flush()
            await client.read_until(lambda: sid2 in client.answers and client.answers[sid2].done)
            assert client.answers[sid].headers[b":status"] == b"405"
            assert client.answers[sid2].headers[b":status"] == b"415"
            assert grpc_server.budget.held == 0
            await client.close()
            await grpc_server.stop(1)

    run(main)


@contextlib.asynccontextmanager
async def held(models, **kw):
    """``mlp`` served with every batch held on "the device" until ``gate.release``:
    yields (server, its gRPC server, a connected client, the gate); stops them after."""
    with inject(models["mlp"], hold=True) as gate:
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server, **kw)
            client = await Client.connect(port)
            try:
                yield server, grpc_server, client, gate
            finally:
                gate.release.set()
                await client.close()
                await grpc_server.stop(1)


def test_compressed_requests(models, run):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server)
            client = await Client.connect(port)
            x = np.arange(64, dtype=np.float32).reshape(2, 32)
            message = infer_message(x)
            sid = client.open("ModelInfer", [(b"grpc-encoding", b"gzip")])
            await client.send(sid, framed(gzip.compress(message), True), end=True)
            await client.read_until(lambda: client.answers[sid].done)
            assert client.answers[sid].status == 0
            assert_matches({"y": y_of(messages(client.answers[sid].data)[0])},
                           reference("mlp", {"x": x}))  # fmt: skip
            sid = client.open("ModelInfer")  # compressed, but no grpc-encoding
            await client.send(sid, framed(gzip.compress(message), True), end=True)
            await client.read_until(lambda: client.answers[sid].done)
            assert client.answers[sid].status == 13
            answer = await client.call("ModelInfer", message, [(b"grpc-encoding", b"br")])
            assert answer.status == 12 and "not supported" in answer.message
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_grpc_timeout_is_the_deadline_in_the_queue(models, run):
    async def main():
        async with held(models) as (server, grpc_server, client, gate):
            message = infer_message(np.ones((1, 32), np.float32))
            first = client.open("ModelInfer")
            await client.send(first, framed(message), end=True)
            await gate.wait_started()  # the device busy: the next request waits
            late = await client.call("ModelInfer", message, [(b"grpc-timeout", b"50m")])
            assert late.status == 4, late.message  # DEADLINE_EXCEEDED
            gate.release.set()
            await client.read_until(lambda: client.answers[first].done)
            assert client.answers[first].status == 0

    run(main)


def test_a_reset_call_leaves_the_queue(models, run):
    async def main():
        async with held(models) as (server, grpc_server, client, gate):
            message = infer_message(np.ones((1, 32), np.float32))
            first = client.open("ModelInfer")
            await client.send(first, framed(message), end=True)
            await gate.wait_started()
            waiting = [client.open("ModelInfer") for _ in range(3)]
            for sid in waiting:
                client.conn.send_data(sid, framed(message), end_stream=True)
            await client.flush()
            await until(lambda: server.stats("mlp")["queued_rows"] >= 2)
            for sid in waiting:
                client.conn.reset_stream(sid)
            await client.flush()
            await until(lambda: grpc_server.budget.held == len(framed(message)))  # (the first's)
            gate.release.set()
            await client.read_until(lambda: client.answers[first].done)
            assert client.answers[first].status == 0, client.answers[first].message
            await until(lambda: server.stats("mlp")["requests"]["success"] == 1)
            assert server.stats("mlp")["requests"]["cancelled"] == 3  # never executed
            assert grpc_server.budget.held == 0

    run(main)


def test_a_stream_takes_at_most_its_cap_and_answers_each_alone(models, run):
    """ModelStreamInfer: past max_stream_inflight unanswered requests the rest wait
    (not taken, the client's window not given back); every request is answered, a bad
    one with its own error and id, in completion order."""

    async def main():
        async with held(models, limits=GrpcLimits(max_stream_inflight=4)) as (
            server, grpc_server, client, gate):  # fmt: skip
            submitted = []
            submit = server.submit

            def counting_submit(name, inputs, **kw):
                submitted.append(name)
                return submit(name, inputs, **kw)

            server.submit = counting_submit
            sid = client.open("ModelStreamInfer")
            for i in range(20):
                x = np.full((1, 31 if i == 7 else 32), i, np.float32)
                client.conn.send_data(sid, framed(infer_message(x, rid=str(i))))
            await client.flush()
            await gate.wait_started()
            await asyncio.sleep(0.2)  # time to take more, were the cap not held
            assert len(submitted) <= 4
            gate.release.set()
            await client.read_until(lambda: len(messages(client.answers[sid].data)) == 20)
            assert grpc_server.budget.held == 0  # each answer gave back its request's bytes
            client.conn.end_stream(sid)
            await client.flush()
            await client.read_until(lambda: client.answers[sid].done)
            answer = client.answers[sid]
            assert answer.status == 0, answer.message
            got = [pb.ModelStreamInferResponse.FromString(m) for m in messages(answer.data)]
            assert sorted(int(g.infer_response.id) for g in got) == list(range(20))
            errors = [g for g in got if g.error_message]
            assert [g.infer_response.id for g in errors] == ["7"]
            assert "input 'x'" in errors[0].error_message
            for g in got:
                if not g.error_message:
                    i = int(g.infer_response.id)
                    y = np.frombuffer(g.infer_response.raw_output_contents[0], np.float32)
                    want = reference("mlp", {"x": np.full((1, 32), i, np.float32)})["y"]
                    np.testing.assert_allclose(y.reshape(1, 32), want, rtol=1e-5, atol=1e-5)
            assert grpc_server.budget.held == 0

    run(main)


def test_draining_answers_what_a_stream_took_then_ends_it_unavailable(models, run):
    async def main():
        async with held(models) as (server, grpc_server, client, gate):
            x = np.ones((1, 32), np.float32)
            sid = client.open("ModelStreamInfer")
            for i in range(3):
                client.conn.send_data(sid, framed(infer_message(x, rid=str(i))))
            await client.flush()
            await gate.wait_started()
            size = len(framed(infer_message(x, rid="0")))  # held until its answer
            await until(lambda: grpc_server.budget.held == 3 * size)  # all three taken
            server.drain()
            await asyncio.sleep(0)
            client.conn.send_data(sid, framed(infer_message(x, rid="late")))
            await client.flush()
            unary = await client.call("ModelInfer", infer_message(x))
            assert unary.status == 14 and "draining" in unary.message
            gate.release.set()
            await client.read_until(lambda: client.answers[sid].done)
            answer = client.answers[sid]
            ids = [pb.ModelStreamInferResponse.FromString(m).infer_response.id
                   for m in messages(answer.data)]  # fmt: skip
            assert sorted(ids) == ["0", "1", "2"]
            assert answer.status == 14 and "draining" in answer.message
            await grpc_server.stop(5)  # GOAWAY, then closed
            await client.read_until(lambda: client.closed or client.goaway is not None)
            assert client.goaway is not None and client.goaway.error_code == 0

    run(main)


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return h2.frame_head(kind, flags, sid, len(payload)) + payload


VIOLATIONS = {
    "DATA on an idle stream": (_frame(h2.DATA, 0, 99, b"x"), h2.PROTOCOL_ERROR),
    "PUSH_PROMISE from a client": (_frame(h2.PUSH_PROMISE, 4, 1, b"\0\0\0\2"), h2.PROTOCOL_ERROR),
    "a frame over the maximum size": (h2.frame_head(h2.DATA, 0, 1, 1 << 21), h2.FRAME_SIZE_ERROR),
    "an undecodable header block": (_frame(h2.HEADERS, 5, 1, b"\x80"), h2.COMPRESSION_ERROR),
    "a client stream with an even id": (_frame(h2.HEADERS, 5, 2, b"\x83"), h2.PROTOCOL_ERROR),
    "a WINDOW_UPDATE of 0": (_frame(h2.WINDOW_UPDATE, 0, 0, b"\0\0\0\0"), h2.PROTOCOL_ERROR),
    "a header block interrupted": (
        _frame(h2.HEADERS, 0, 1, b"\x83") + _frame(h2.PING, 0, 0, b"x" * 8), h2.PROTOCOL_ERROR),
    "SETTINGS of a bad length": (_frame(h2.SETTINGS, 0, 0, b"\0\0\0"), h2.FRAME_SIZE_ERROR),
    "a short GOAWAY": (_frame(h2.GOAWAY, 0, 0, b"\0\0\0"), h2.FRAME_SIZE_ERROR),
    "a PRIORITY of a bad length": (_frame(h2.PRIORITY, 0, 3, b"\0\0"), h2.FRAME_SIZE_ERROR),
    "a header block bomb": (
        _frame(h2.HEADERS, 5, 1, b"\x40\x01k\x7f\xa1\x1e" + b"v" * 4000 + b"\xbe" * 50),
        h2.COMPRESSION_ERROR),
}  # fmt: skip


@pytest.mark.parametrize("frames", list(VIOLATIONS), ids=list(VIOLATIONS))
def test_protocol_violations_end_the_connection_with_goaway(models, run, frames):
    raw, code = VIOLATIONS[frames]

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server)
            client = await Client.connect(port)
            await client.read_until(lambda: client.received > 0)  # the server's SETTINGS
            await client.raw(raw)
            await client.read_until(lambda: client.closed, 10)
            assert client.goaway is not None and client.goaway.error_code == code
            await client.close()
            await until(lambda: not grpc_server.connections.open)
            await grpc_server.stop(1)

    run(main)


def test_not_http2_is_closed(models, run):
    async def main():
        async with Server() as server:
            grpc_server, port = await serve(server)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            data = await asyncio.wait_for(reader.read(), 10)  # until the server closes
            assert b"HTTP/1.1" not in data
            writer.close()
            await grpc_server.stop(1)

    run(main)


def test_pings_answered_and_a_ping_flood_sent_away(models, run):
    async def main():
        async with Server() as server:
            grpc_server, port = await serve(server)
            client = await Client.connect(port)
            client.conn.ping(b"12345678")
            await client.flush()
            await client.read_until(lambda: client.pings)
            assert client.pings == [b"12345678"]
            for i in range(5):  # quiet pings, far more often than min_client_ping_s
                await client.raw(_frame(h2.PING, 0, 0, b"%08d" % i))
            await client.read_until(lambda: client.closed, 10)
            assert client.goaway.error_code == h2.ENHANCE_YOUR_CALM
            assert client.goaway.additional_data == b"too_many_pings"
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_streams_over_the_limit_are_refused(models, run):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server, settings=h2.Settings(max_concurrent_streams=2))
            client = await Client.connect(port)
            await client.read_until(lambda: client.received > 0)
            frames = b"".join(
                _frame(h2.HEADERS, h2.END_HEADERS, sid, h2.encode_headers(
                    [(b":method", b"POST"), (b":path", (PATH + "ModelInfer").encode()),
                     (b"content-type", b"application/grpc")]))
                for sid in (101, 103, 105)
            )  # fmt: skip
            await client.raw(frames)
            refused = _frame(h2.RST_STREAM, 0, 105, h2.REFUSED_STREAM.to_bytes(4, "big"))
            data = b""
            while refused not in data:  # RST_STREAM(REFUSED_STREAM) for the third only
                data += await asyncio.wait_for(client.reader.read(1 << 16), 10)
            assert h2.frame_head(h2.RST_STREAM, 0, 101, 4) not in data
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_limits_on_connections_handshakes_stalls_and_bytes_held(models, run):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            limits = GrpcLimits(max_connections=2, handshake_timeout_s=0.3, idle_timeout_s=1.0)
            grpc_server, port = await serve(
                server, limits=limits, body_timeout_s=0.3, budget=BodyBudget(3000)
            )
            silent = await asyncio.open_connection("127.0.0.1", port)
            client = await Client.connect(port)
            refused = await Client.connect(port)  # a third: over the cap
            # part of a message, then nothing: the call fails, its bytes given back
            sid = client.open("ModelInfer")
            client.conn.send_data(sid, framed(infer_message(np.ones((1, 32), np.float32)))[:50])
            await client.flush()
            await client.read_until(lambda: client.answers[sid].done)
            assert client.answers[sid].status == 4, client.answers[sid].message
            assert "no part of its request for 0.3 s" in client.answers[sid].message
            assert grpc_server.budget.held == 0
            # more than the budget of bytes held: UNAVAILABLE, retry later
            big = await client.call("ModelInfer", infer_message(np.ones((30, 32), np.float32)))
            assert big.status == 14 and "retry later" in big.message
            assert grpc_server.budget.held == 0
            ok = await client.call("ModelInfer", infer_message(np.ones((1, 32), np.float32)))
            assert ok.status == 0
            await refused.read_until(lambda: refused.closed, 10)
            assert refused.goaway.error_code == h2.ENHANCE_YOUR_CALM
            # no handshake in time: closed (after the server's own preface)
            assert await asyncio.wait_for(silent[0].read(), 10) == h2.Settings().frames()
            await client.read_until(lambda: client.goaway is not None, 10)  # idle: GOAWAY
            assert client.goaway.error_code == 0 and client.goaway.additional_data == b"idle"
            await client.close()
            await refused.close()
            silent[1].close()
            await grpc_server.stop(1)

    run(main)


class _Transport:
    """A connection's transport for feeding a protocol bytes in memory."""

    def __init__(self) -> None:
        self.closing = False

    def write(self, data) -> None:
        pass

    def writelines(self, parts) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return default


_KINDS = st.sampled_from([0, 1, 2, 3, 4, 6, 7, 8, 9, 0xA])
_frames = st.tuples(_KINDS, st.integers(0, 255), st.sampled_from([0, 1, 3, 5, 2**31 - 1]),
                    st.binary(max_size=40))  # fmt: skip


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    frames=st.lists(_frames, max_size=12),
    good=st.booleans(),
)
def test_random_frames_never_break_the_server(models, frames, good):
    """Random frames after a valid preface (some after a valid call): the protocol
    answers or closes, never raises, and gives back every byte of its budget."""

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            owner = GrpcServer(server, max_message_bytes=1 << 20, control=server)
            proto = GrpcProtocol(owner)
            proto.connection_made(_Transport())
            data = h2.PREFACE + _frame(h2.SETTINGS, 0, 0, b"")
            if good:
                block = h2.encode_headers(
                    [(b":method", b"POST"), (b":path", (PATH + "ModelInfer").encode()),
                     (b"content-type", b"application/grpc")])  # fmt: skip
                message = framed(infer_message(np.ones((1, 32), np.float32)))
                data += _frame(h2.HEADERS, h2.END_HEADERS, 1, block)
                data += _frame(h2.DATA, h2.END_STREAM, 1, message)
            for kind, flags, sid, payload in frames:
                data += _frame(kind, flags, sid, payload)
            proto.data_received(data)
            for _ in range(20):
                await asyncio.sleep(0)
            proto.connection_lost(None)
            await asyncio.sleep(0.01)
            assert owner.budget.held == 0
            owner.connections.close()

    loop = asyncio.new_event_loop()
    errors = []
    loop.set_exception_handler(lambda loop, ctx: errors.append(ctx))
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert not errors, errors


def test_a_malformed_message_is_that_whatever_its_first_bytes_name(models, run):
    # The model name is read off a message's first bytes (where serializers put it):
    # a message broken after them is still answered as malformed, not as an unknown model.
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server)
            client = await Client.connect(port)
            good = infer_message(np.ones((1, 32), np.float32))
            for name in (b"mlp", b"nope"):
                broken = b"\x0a" + bytes([len(name)]) + name + b"\x2a\xff\xff\xff\x0f"
                answer = await client.call("ModelInfer", broken)
                assert answer.status == 3 and "not a valid protobuf" in answer.message, name
            sid = client.open("ModelStreamInfer")
            client.conn.send_data(sid, framed(b"\x0a\x04nope\x2a\xff\xff\xff\x0f"))
            client.conn.send_data(sid, framed(good), end_stream=True)
            await client.flush()
            await client.read_until(lambda: client.answers[sid].done)
            got = [
                pb.ModelStreamInferResponse.FromString(m)
                for m in messages(client.answers[sid].data)
            ]
            assert sorted(bool(g.error_message) for g in got) == [False, True]
            assert "not a valid protobuf" in max(g.error_message for g in got)
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_a_message_laid_out_as_one_seen_before_decodes_as_the_first_time(models):
    """InferRequest.from_proto_bytes remembers a message's layout per model: a message
    laid out the same decodes to its own bytes' arrays, as a full parse would; one that
    differs anywhere outside the tensors' bytes (its id, its contents split otherwise at
    the same size, its outputs) takes the full parse and its checks."""
    from serving.kserve import codec
    from serving.kserve.core import InferRequest

    mlp = models["mlp"]
    parse = pb.ModelInferRequest.FromString
    rng = np.random.default_rng(5)

    def fresh(data):
        return InferRequest.from_proto(parse(data), mlp)

    def same(a, b):
        assert a.inputs.keys() == b.inputs.keys()
        for k in a.inputs:
            np.testing.assert_array_equal(a.inputs[k], b.inputs[k])
            assert a.inputs[k].shape == b.inputs[k].shape
        assert (a.outputs, a.id, a.timeout_s) == (b.outputs, b.id, b.timeout_s)

    x = [rng.standard_normal((1, 32)).astype(np.float32) for _ in range(3)]
    first = infer_message(x[0], rid="a1")
    InferRequest.from_proto_bytes(first, mlp, parse)  # remembered
    plan = codec.ProtoPlan.of(first, fresh(first).inputs, [("y", True)], "a1", None, 0)
    assert plan is not None and plan.matches(infer_message(x[1], rid="a1"))
    for data in (infer_message(x[1], rid="a1"), infer_message(x[2], rid="b2")):
        got = InferRequest.from_proto_bytes(data, mlp, parse)
        same(got, fresh(data))
        assert got.inputs["x"].base is not None  # a view of the message's bytes
    request = pb.ModelInferRequest.FromString(first)
    request.parameters["timeout"].int64_param = 5000
    request.outputs.add(name="y")
    data = request.SerializeToString()
    for _ in range(2):
        got = InferRequest.from_proto_bytes(data, mlp, parse, deadline_s=9.0)
        assert (got.timeout_s, got.outputs) == (0.005, [("y", True)])
    # the same size, the raw contents split in two: not the layout remembered
    prefix = first[: first.index(b"\x3a\x80\x01")]
    split = prefix + b"\x3a\x3f" + b"\0" * 63 + b"\x3a\x40" + b"\0" * 64
    assert len(split) == len(first)
    with pytest.raises(codec.ProtocolError, match="2 raw_input_contents for 1 inputs"):
        InferRequest.from_proto_bytes(split, mlp, parse)
    # another model's plans are its own: the same bytes against two_io's inputs
    with pytest.raises(codec.ProtocolError, match="unexpected input 'x'"):
        InferRequest.from_proto_bytes(first, models["two_io"], parse)


def test_floods_of_resets_and_empty_continuations_are_sent_away(models, run):
    """Streams opened only to be reset (the "rapid reset" attack) and header blocks of
    endless empty CONTINUATION frames end the connection with ENHANCE_YOUR_CALM."""

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server)
            grpc_server.connections.max_client_resets = 50
            client = await Client.connect(port)
            message = framed(infer_message(np.ones((1, 32), np.float32)))
            for _ in range(60):
                sid = client.open("ModelInfer")
                client.conn.send_data(sid, message[:10])  # not done: the reset cancels work
                client.conn.reset_stream(sid)
            await client.flush()
            await client.read_until(lambda: client.closed, 10)
            assert client.goaway.error_code == h2.ENHANCE_YOUR_CALM
            assert client.goaway.additional_data == b"too many streams reset"
            await client.close()
            client = await Client.connect(port)
            await client.read_until(lambda: client.received > 0)
            flood = _frame(h2.HEADERS, 0, 1, b"\x83") + _frame(h2.CONTINUATION, 0, 1, b"") * 8000
            await client.raw(flood)
            await client.read_until(lambda: client.closed, 10)
            assert client.goaway.error_code == h2.ENHANCE_YOUR_CALM
            await client.close()
            assert grpc_server.budget.held == 0
            await grpc_server.stop(1)

    run(main)


def _stream_answers(answer: Answer) -> list:
    return [pb.ModelStreamInferResponse.FromString(m) for m in messages(answer.data)]


def test_pings_between_answers_are_not_strikes(models, run):
    # grpc clients ping as answers arrive (BDP estimation), with nothing sent between:
    # the server's own data between two pings makes the second one not a strike.
    async def main():
        with inject(models["mlp"], delay_s=0.05):
            async with Server() as server:
                server.add_model("mlp", models["mlp"], max_batch_size=1)
                grpc_server, port = await serve(server)
                client = await Client.connect(port)
                sid = client.open("ModelStreamInfer")
                x = np.ones((1, 32), np.float32)
                for i in range(6):
                    client.conn.send_data(sid, framed(infer_message(x, rid=str(i))))
                await client.flush()
                for i in range(6):
                    await client.read_until(lambda i=i: len(messages(client.answers[sid].data)) > i)
                    client.conn.ping(b"%08d" % i)
                    await client.flush()
                client.conn.end_stream(sid)
                await client.flush()
                await client.read_until(lambda: client.answers[sid].done)
                assert client.answers[sid].status == 0 and client.goaway is None
                await client.close()
                await grpc_server.stop(1)

    run(main)


def test_a_stream_ends_with_its_error_while_answers_wait_for_the_window(models, run):
    """A stream whose answers wait for the client's window and which then fails ends
    with that error: nothing else is taken or sent on it, its bytes are all given back."""

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server, max_message_bytes=4096)
            client = await Client.connect(port, auto_ack=False)
            client.conn.update_settings({4: 200})  # INITIAL_WINDOW_SIZE: about one answer
            await client.flush()
            sid = client.open("ModelStreamInfer")
            x = np.ones((1, 32), np.float32)
            for i in range(4):
                client.conn.send_data(sid, framed(infer_message(x, rid=str(i))))
            await client.flush()
            await client.read_until(lambda: client.answers[sid].data)  # one answer's worth
            await asyncio.sleep(0.1)  # the others wait for the window
            client.conn.send_data(sid, framed(infer_message(np.ones((40, 32), np.float32))))
            client.conn.send_data(sid, framed(infer_message(x, rid="after")), end_stream=True)
            await client.flush()
            for _ in range(100):  # open the window bit by bit until the stream ends
                client.conn.increment_flow_control_window(200, sid)
                client.conn.increment_flow_control_window(200)
                await client.flush()
                try:
                    await client.read_until(lambda: client.answers[sid].done, 0.05)
                except TimeoutError:
                    continue
                break
            answer = client.answers[sid]
            assert answer.status == 8 and "larger than max" in answer.message
            assert "after" not in {g.infer_response.id for g in _stream_answers(answer)}
            await until(lambda: grpc_server.budget.held == 0)
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_a_long_backlog_of_bad_requests_is_answered_without_recursion(models, run):
    async def main():
        async with held(models, limits=GrpcLimits(max_stream_inflight=1)) as (
            server, grpc_server, client, gate):  # fmt: skip
            sid = client.open("ModelStreamInfer")
            client.conn.send_data(sid, framed(infer_message(np.ones((1, 32), np.float32))))
            bad = framed(b"")  # no model: each fails alone
            await client.send(sid, bad * 1500, end=True)
            await gate.wait_started()
            gate.release.set()
            await client.read_until(lambda: client.answers[sid].done)
            answer = client.answers[sid]
            got = _stream_answers(answer)
            assert answer.status == 0 and len(got) == 1501
            assert sum(bool(g.error_message) for g in got) == 1500
            assert grpc_server.budget.held == 0

    run(main)


def test_answers_held_by_the_clients_window_count_against_the_cap(models, run):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            submitted = []
            submit = server.submit
            server.submit = lambda *a, **kw: submitted.append(1) or submit(*a, **kw)
            grpc_server, port = await serve(server, limits=GrpcLimits(max_stream_inflight=4))
            client = await Client.connect(port, auto_ack=False)
            client.conn.update_settings({4: 200})  # about one answer
            await client.flush()
            sid = client.open("ModelStreamInfer")
            x = np.ones((1, 32), np.float32)
            for i in range(40):
                client.conn.send_data(sid, framed(infer_message(x, rid=str(i))))
            client.conn.end_stream(sid)
            await client.flush()
            await client.read_until(lambda: client.answers[sid].data)
            await asyncio.sleep(0.2)  # time to take more, were queued answers not counted
            assert len(submitted) <= 8
            while not client.answers[sid].done:
                client.conn.increment_flow_control_window(1 << 16, sid)
                client.conn.increment_flow_control_window(1 << 16)
                await client.flush()
                try:
                    await client.read_until(lambda: client.answers[sid].done, 0.05)
                except TimeoutError:
                    pass
            assert len(_stream_answers(client.answers[sid])) == 40
            assert grpc_server.budget.held == 0
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_a_stream_the_server_holds_is_not_timed_out(models, run):
    # Its backlog holds the client's window: the rest of a message cannot come, and the
    # stall sweep must not blame the client for it.
    async def main():
        async with held(
            models, limits=GrpcLimits(max_stream_inflight=1), body_timeout_s=0.2,
            settings=h2.Settings(initial_window=400),
        ) as (server, grpc_server, client, gate):  # fmt: skip
            await client.read_until(lambda: client.received > 0)  # the server's SETTINGS
            sid = client.open("ModelStreamInfer")
            message = framed(infer_message(np.ones((1, 32), np.float32)))
            room = client.conn.local_flow_control_window(sid)
            data = message * 3
            client.conn.send_data(sid, data[:room])  # two whole, the third cut by the window
            await client.flush()
            await gate.wait_started()
            await asyncio.sleep(0.8)  # four sweeps' worth of no progress
            gate.release.set()
            await client.send(sid, data[room:], end=True)
            await client.read_until(lambda: client.answers[sid].done)
            assert client.answers[sid].status == 0, client.answers[sid].message
            assert len(_stream_answers(client.answers[sid])) == 3

    run(main)


def test_request_bytes_are_budgeted_inflated_and_unary_calls_time_out(models, run):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(
                server, budget=BodyBudget(100_000), body_timeout_s=0.3,
                max_message_bytes=4 << 20,
            )  # fmt: skip
            client = await Client.connect(port)
            zeros = infer_message(np.zeros((2000, 32), np.float32))  # 256 KB, gzips to ~1 KB
            sid = client.open("ModelInfer", [(b"grpc-encoding", b"gzip")])
            await client.send(sid, framed(gzip.compress(zeros), True), end=True)
            await client.read_until(lambda: client.answers[sid].done)
            assert client.answers[sid].status == 14 and "retry later" in client.answers[sid].message
            cut = gzip.compress(infer_message(np.ones((1, 32), np.float32)))[:-6]
            sid = client.open("ModelInfer", [(b"grpc-encoding", b"gzip")])
            await client.send(sid, framed(cut, True), end=True)
            await client.read_until(lambda: client.answers[sid].done)
            assert client.answers[sid].status == 13 and "cut short" in client.answers[sid].message
            # a whole message and no END_STREAM, then nothing: timed out like a stalled one
            sid = client.open("ModelInfer")
            client.conn.send_data(sid, framed(infer_message(np.ones((1, 32), np.float32))))
            await client.flush()
            await client.read_until(lambda: client.answers[sid].done)
            assert client.answers[sid].status == 4
            # a message in one-byte frames: put together, answered
            x = np.arange(64, dtype=np.float32).reshape(2, 32)
            sid = client.open("ModelInfer")
            data = framed(infer_message(x))
            for i in range(len(data)):
                client.conn.send_data(sid, data[i : i + 1], end_stream=i == len(data) - 1)
            await client.flush()
            await client.read_until(lambda: client.answers[sid].done)
            assert_matches({"y": y_of(messages(client.answers[sid].data)[0])},
                           reference("mlp", {"x": x}))  # fmt: skip
            assert grpc_server.budget.held == 0
            # a model named twice: protobuf keeps the last; refused rather than misrouted
            twice = b"\x0a\x03mlp" + infer_message(np.ones((1, 32), np.float32), model="nope")
            answer = await client.call("ModelInfer", twice)
            assert answer.status == 3 and "more than once" in answer.message
            # a client that shrinks its HPACK table is told in the next block (h2 checks)
            client.conn.update_settings({1: 0})
            await client.flush()
            ok = await client.call("ModelInfer", infer_message(np.ones((1, 32), np.float32)))
            assert ok.status == 0
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_the_lean_grpc_client_against_pxrt_serve(served, run):
    """serving.bench.h2client: concurrent unary calls on one HTTP/2 connection give the
    answers grpcio would; an error status is raised and the connection goes on."""
    from tritonclient.grpc import service_pb2 as pb

    from serving.bench.h2client import GrpcError, connect

    x = np.arange(64, dtype=np.float32).reshape(2, 32)
    request = pb.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="x", datatype="FP32", shape=[2, 32])
    request.raw_input_contents.append(x.tobytes())
    good = request.SerializeToString()
    bad = pb.ModelInferRequest(model_name="nope").SerializeToString()
    path = b"/inference.GRPCInferenceService/ModelInfer"

    async def main():
        host, _, port = served.grpc_url.rpartition(":")
        conn = await connect(host, int(port))
        try:
            answers = await asyncio.gather(*(conn.unary(path, good) for _ in range(150)))
            with pytest.raises(GrpcError, match="no model named 'nope'") as caught:
                await conn.unary(path, bad)
            again = await conn.unary(path, good)
        finally:
            conn.close()
        return answers, caught.value.status, again

    answers, status, again = run(main)
    outs = [pb.ModelInferResponse.FromString(a) for a in [*answers, again]]
    assert status == 5  # NOT_FOUND
    want = outs[0].raw_output_contents[0]
    assert all(o.model_name == "mlp" and o.raw_output_contents[0] == want for o in outs)


# --------------------------------------------------------------------------- hardening


def _open_frame(sid: int, method: str = "ModelInfer", end: bool = False) -> bytes:
    block = h2.encode_headers(
        [(b":method", b"POST"), (b":path", (PATH + method).encode()),
         (b"content-type", b"application/grpc")])  # fmt: skip
    return _frame(h2.HEADERS, h2.END_HEADERS | (h2.END_STREAM if end else 0), sid, block)


async def raw_goaway(client: Client) -> tuple[int, bytes]:
    """Read a connection to its end as raw frames (not through the h2 state machine: the
    test sent frames it does not know of): its GOAWAY's error code and debug data."""
    data = b""
    while chunk := await asyncio.wait_for(client.reader.read(1 << 16), 10):
        data += chunk
    pos, found = 0, None
    while len(data) - pos >= 9:
        length = int.from_bytes(data[pos : pos + 3], "big")
        if data[pos + 3] == h2.GOAWAY:
            body = data[pos + 9 : pos + 9 + length]
            found = int.from_bytes(body[4:8], "big"), body[8:]
        pos += 9 + length
    assert found is not None, "no GOAWAY"
    return found


CONTROL_FLOODS = {
    "SETTINGS": lambda i: _frame(h2.SETTINGS, 0, 0, b"\0\4" + (i % 2).to_bytes(4, "big")),
    "WINDOW_UPDATE": lambda i: _frame(h2.WINDOW_UPDATE, 0, 0, b"\0\0\0\1"),
    "PRIORITY": lambda i: _frame(h2.PRIORITY, 0, 1, b"\0\0\0\0\x10"),
    "empty DATA": lambda i: _frame(h2.DATA, 0, 1, b""),
    "RST_STREAM of a closed stream": lambda i: _frame(h2.RST_STREAM, 0, 1, b"\0\0\0\x08"),
    "an unknown type": lambda i: _frame(0x20, 0, 0, b"x"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(CONTROL_FLOODS))
def test_floods_of_control_frames_are_sent_away(models, run, kind):
    """Frames that carry no request count against an allowance (here 50 per window):
    a client that only sends them is sent away (ENHANCE_YOUR_CALM)."""

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server, limits=GrpcLimits(max_control_frames=50))
            client = await Client.connect(port)
            await client.read_until(lambda: client.received > 0)
            await client.raw(_open_frame(1, "ModelStreamInfer"))  # a stream the frames name
            await client.raw(b"".join(CONTROL_FLOODS[kind](i) for i in range(200)))
            code, why = await raw_goaway(client)
            assert (code, why) == (h2.ENHANCE_YOUR_CALM, b"too many control frames")
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_control_frames_that_answer_the_servers_data_are_not_a_flood(models, run):
    """A client acknowledging every answer (a WINDOW_UPDATE per DATA frame, both the
    stream's and the connection's) and pinging between them is not sent away, however
    many calls it makes: each DATA frame the server sends earns two."""

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            limits = GrpcLimits(max_control_frames=20)
            grpc_server, port = await serve(server, limits=limits, max_message_bytes=1 << 16)
            client = await Client.connect(port)
            client.conn.update_settings({4: 300})  # small windows: answers come in pieces
            await client.flush()
            x = np.ones((8, 32), np.float32)
            for i in range(60):
                answer = await client.call("ModelInfer", infer_message(x, rid=str(i)))
                assert answer.status == 0, answer.message
            assert client.goaway is None
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_a_new_initial_window_touches_no_stream(models, run):
    """A SETTINGS that changes the initial window costs the same with 1,000 streams open
    as with none: no stream is visited (the flood of the issue cost 88-120 us a frame)."""

    class Counting(dict):
        visits = 0

        def values(self):
            Counting.visits += 1
            return super().values()

        def __iter__(self):
            Counting.visits += 1
            return super().__iter__()

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            owner = GrpcServer(server, max_message_bytes=1 << 20, control=server)
            proto = GrpcProtocol(owner)
            proto.connection_made(_Transport())
            opens = b"".join(_open_frame(2 * i + 1, "ModelStreamInfer") for i in range(1000))
            proto.data_received(h2.PREFACE + _frame(h2.SETTINGS, 0, 0, b"") + opens)
            assert len(proto.streams) == 1000
            proto.streams = Counting(proto.streams)
            for window in (0, 1 << 20, 5, 1 << 16):
                setting = (4).to_bytes(2, "big") + window.to_bytes(4, "big")
                proto.data_received(_frame(h2.SETTINGS, 0, 0, setting))
            assert Counting.visits == 0 and not proto.closed
            assert proto.peer_initial_window == 1 << 16
            proto.connection_lost(None)
            assert owner.connections.streams == 0
            owner.connections.close()

    run(main)


def test_a_client_that_reads_no_answers_holds_a_bounded_amount(models, run):
    """A client advertising a zero window that never opens it: answers wait up to
    ``max_queued_bytes`` (then new calls are refused and answers that would wait end
    RESOURCE_EXHAUSTED), and an answer that does not move for ``send_timeout_s`` is
    dropped with its call (RST_STREAM CANCEL): nothing is held for long."""

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            limits = GrpcLimits(max_queued_bytes=3000, send_timeout_s=0.6)
            grpc_server, port = await serve(server, limits=limits)
            client = await Client.connect(port, auto_ack=False)
            client.conn.update_settings({4: 0})  # INITIAL_WINDOW_SIZE 0, never opened
            await client.flush()
            await client.read_until(lambda: client.received > 0)
            x = np.ones((16, 32), np.float32)  # answers of ~2.1 KB
            sids = []
            for i in range(8):  # all sent before any is answered
                sids.append(client.open("ModelInfer"))
                client.conn.send_data(sids[-1], framed(infer_message(x, rid=str(i))), True)
            await client.flush()
            answers = [client.answers[s] for s in sids]
            await client.read_until(lambda: all(a.headers or a.done for a in answers), 10)
            (conn,) = grpc_server.connections.open
            waiting = [a for a in answers if not a.done]
            failed = [a for a in answers if a.status == 8]
            assert len(waiting) == 2 and conn.queued_bytes < 3000 + 2200, conn.queued_bytes
            assert len(failed) == 6 and "has not read" in failed[0].message
            late = await client.call("ModelInfer", infer_message(x), timeout_s=10)
            assert late.reset == h2.REFUSED_STREAM  # a new call while over the bound
            await client.read_until(lambda: all(a.done for a in waiting), 10)
            assert all(a.reset == h2.CANCEL for a in waiting)  # the send timeout
            assert conn.queued_bytes == 0 and not conn.streams
            ok = await client.call("ModelInfer", infer_message(np.ones((1, 32), np.float32)))
            assert ok.headers  # taken again (its answer waits for the window, as asked)
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_resets_the_client_makes_the_server_send_count_as_its_own(models, run):
    """ "MadeYouReset": frames that make the server reset a stream (a zero WINDOW_UPDATE,
    a second header block that does not end it) count toward the rapid-reset limit like
    the client's RST."""

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server)
            grpc_server.connections.max_client_resets = 50
            client = await Client.connect(port)
            await client.read_until(lambda: client.received > 0)
            frames = b""
            for i in range(30):
                sid = 2 * i + 1
                frames += _open_frame(sid) + _frame(h2.WINDOW_UPDATE, 0, sid, b"\0\0\0\0")
            for i in range(30, 60):
                sid = 2 * i + 1
                frames += _open_frame(sid) + _open_frame(sid)  # "trailers" not ending it
            await client.raw(frames)
            code, why = await raw_goaway(client)
            assert (code, why) == (h2.ENHANCE_YOUR_CALM, b"too many streams reset")
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_streams_are_capped_per_process_and_idle_streams_end(models, run):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            limits = GrpcLimits(max_streams=3, stream_idle_timeout_s=0.5)
            grpc_server, port = await serve(server, limits=limits)
            first, second = await Client.connect(port), await Client.connect(port)
            streams = [first.open("ModelStreamInfer") for _ in range(2)]
            await first.flush()
            await until(lambda: grpc_server.connections.streams == 2)
            a = second.open("ModelStreamInfer")
            b = second.open("ModelStreamInfer")  # the fourth over both connections
            await second.flush()
            await second.read_until(lambda: second.answers[b].done, 10)
            assert second.answers[b].reset == h2.REFUSED_STREAM
            assert not second.answers[a].done
            # one stream answers a request, then waits: idle, it ends UNAVAILABLE
            x = np.ones((1, 32), np.float32)
            first.conn.send_data(streams[0], framed(infer_message(x, rid="r")))
            await first.flush()
            await first.read_until(lambda: first.answers[streams[0]].done, 10)
            answer = first.answers[streams[0]]
            assert [g.infer_response.id for g in _stream_answers(answer)] == ["r"]
            assert answer.status == 14 and "idle for 0.5 s" in answer.message
            await until(lambda: grpc_server.connections.streams == 0)
            await first.close()
            await second.close()
            await grpc_server.stop(1)

    run(main)


def test_a_malformed_timeout_or_compressed_flag_is_invalid(models, run):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server)
            client = await Client.connect(port)
            message = infer_message(np.ones((1, 32), np.float32))
            for value in (b"5x", b"123456789S", b"-1S", b"S"):
                answer = await client.call("ModelInfer", message, [(b"grpc-timeout", value)])
                assert answer.status == 3 and "not a timeout" in answer.message, value
            sid = client.open("ModelInfer", [(b"grpc-encoding", b"gzip")])
            await client.send(sid, b"\x02" + framed(message)[1:], end=True)
            await client.read_until(lambda: client.answers[sid].done)
            answer = client.answers[sid]
            assert answer.status == 3 and "compressed flag is 0 or 1, got 2" in answer.message
            ok = await client.call("ModelInfer", message, [(b"grpc-timeout", b"5S")])
            assert ok.status == 0
            await client.close()
            await grpc_server.stop(1)

    run(main)


def test_a_requests_priority_parameter(models):
    """Triton's ``priority`` request parameter (uint64 or int64) is the request's level,
    parsed or from a remembered layout alike; anything else is INVALID_ARGUMENT's
    protocol error."""
    from serving.kserve import codec
    from serving.kserve.core import InferRequest

    def message(param=None, value=None):
        request = pb.ModelInferRequest(model_name="mlp")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 32])
        request.raw_input_contents.append(np.ones((1, 32), np.float32).tobytes())
        if param is not None:
            setattr(request.parameters["priority"], param, value)
        return request.SerializeToString()

    for param, value, want in [(None, None, 0), ("uint64_param", 2, 2), ("int64_param", 1, 1)]:
        data = message(param, value)
        for _ in range(2):  # (the second: from the remembered layout)
            parse = pb.ModelInferRequest.FromString
            assert InferRequest.from_proto_bytes(data, models["mlp"], parse).priority == want
    for param, value in [("string_param", "1"), ("int64_param", -1), ("bool_param", True),
                         ("uint64_param", 2**63), ("uint64_param", 2**64 - 1),
                         ("double_param", 1.0)]:  # fmt: skip
        with pytest.raises(codec.ProtocolError, match="parameters.priority must be an integer"):
            InferRequest.from_proto(pb.ModelInferRequest.FromString(message(param, value)),
                                    models["mlp"])  # fmt: skip


def test_trace_settings_over_grpc(models, run):
    """Triton's TraceSetting: read, turned off and back on (an empty value is the
    default), the same settings as /v2/trace/setting; one request in the rate traced;
    per-model settings and settings pxrt does not take are refused by name."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from serving import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    def setting(model="", **values):
        request = pb.TraceSettingRequest(model_name=model)
        for key, value in values.items():
            request.settings[key].value.extend(value)
        return request.SerializeToString()

    def settings_of(answer):
        response = pb.TraceSettingResponse.FromString(messages(answer.data)[0])
        return {k: list(v.value) for k, v in response.settings.items()}

    async def main():
        async with Server(tracing=Tracing(2, provider)) as server:
            server.add_model("mlp", models["mlp"])
            grpc_server, port = await serve(server)
            client = await Client.connect(port)
            x = np.ones((1, 32), np.float32)
            got = [settings_of(await client.call("TraceSetting", setting()))]
            for _ in range(4):
                assert (await client.call("ModelInfer", infer_message(x))).status == 0
            traced = len(exporter.get_finished_spans())
            got.append(settings_of(await client.call("TraceSetting", setting(trace_level=["OFF"]))))
            assert (await client.call("ModelInfer", infer_message(x))).status == 0
            assert (await client.call("ModelInfer", infer_message(x))).status == 0
            off = len(exporter.get_finished_spans())
            got.append(settings_of(await client.call("TraceSetting", setting(trace_rate=[]))))
            got.append(
                settings_of(await client.call("TraceSetting", setting(trace_level=["TIMESTAMPS"])))
            )
            bad = [await client.call("TraceSetting", setting(model="mlp")),
                   await client.call("TraceSetting", setting(trace_file=["x"]))]  # fmt: skip
            await client.close()
            await grpc_server.stop(1)
            return got, traced, off, bad

    got, traced, off, bad = run(main)
    assert got[0]["trace_rate"] == ["2"] and got[0]["trace_level"] == ["TIMESTAMPS"]
    assert traced == 2  # two requests of four
    assert got[1]["trace_level"] == ["OFF"] and off == traced
    assert got[2]["trace_rate"] == ["1000"]  # the default, still off: level and rate apart
    assert got[2]["trace_level"] == ["OFF"]
    assert got[3]["trace_level"] == ["TIMESTAMPS"]
    assert bad[0].status == 3 and "server-wide" in bad[0].message
    assert bad[1].status == 3 and "trace_file" in bad[1].message
