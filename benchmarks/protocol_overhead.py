"""The front ends' own code, without sockets: `pxrt serve`'s protocols fed whole requests
by in-memory connections on one event loop, each sending its next request when its reply
is written (closed loop, like perf_analyzer's connections). HTTP's native path and its
ASGI path (the Starlette app, both under the guard over uvicorn's httptools protocol) and
gRPC on pxrt's HTTP/2 (``serving.grpc.native``: HEADERS and DATA frames in, as grpc
clients send them once their HPACK tables are warm) are measured against the floor: the
same requests' decoded inputs through ``Server.submit`` and an awaiting task each, no
protocol. Alternated repeats; prints loop time per request and the ratios. What this
leaves out is the kernel's share (a recv and a send per request), which
`benchmarks/frontend.py` measures with perf_analyzer.

    python benchmarks/protocol_overhead.py [--connections 64] [--requests 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import hpack
import numpy as np
import orjson

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import uvicorn  # noqa: E402
from frontend import export_trivial  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

import pxrt  # noqa: E402
from serving.engine.server import Server, new_event_loop  # noqa: E402
from serving.grpc import h2  # noqa: E402
from serving.grpc.native import GrpcProtocol, GrpcServer  # noqa: E402
from serving.http.app import create_app  # noqa: E402
from serving.http.limits import guarded_protocol  # noqa: E402
from serving.options import HttpLimits  # noqa: E402


def binary_request(x: np.ndarray) -> bytes:
    """An infer request as perf_analyzer sends it (binary tensor, its headers)."""
    header = orjson.dumps(
        {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                     "parameters": {"binary_data_size": x.nbytes}}],
         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    )  # fmt: skip
    body = header + x.tobytes()
    return (
        b"POST /v2/models/trivial/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Accept: */*\r\nInference-Header-Content-Length: %d\r\n"
        b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
        % (len(header), len(body))
    ) + body


class Connection(asyncio.Transport):
    """An in-memory client connection: sends its request, and again on each reply, until
    the run has sent its requests."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run
        self.protocol = run.protocol_class(config=run.config, server_state=run.state, app_state={})
        self.protocol.connection_made(self)
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def send(self) -> None:
        if self.run.sent < self.run.total:
            self.run.sent += 1
            self.protocol.data_received(self.run.request)

    def write(self, data) -> None:
        self.run.replies += 1
        if self.run.replies == self.run.total:
            self.run.done.set()
        self.run.loop.call_soon(self.send)

    def writelines(self, parts) -> None:
        self.write(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Run:
    def __init__(self, app, native: bool, request: bytes, total: int) -> None:
        self.config = uvicorn.Config(app, lifespan="off", log_level="warning")
        self.config.load()
        self.state = ServerState()
        limits = HttpLimits()
        self.protocol_class = guarded_protocol(limits, native=app.state.pxrt if native else None)
        self.request = request
        self.total = total
        self.sent = self.replies = 0
        self.loop = asyncio.get_running_loop()
        self.done = asyncio.Event()


async def http_run(app, native: bool, request: bytes, connections: int, total: int) -> float:
    run = Run(app, native, request, total)
    conns = [Connection(run) for _ in range(connections)]
    t0 = time.perf_counter()
    for conn in conns:
        conn.send()
    await run.done.wait()
    elapsed = time.perf_counter() - t0
    for conn in conns:
        conn.protocol.connection_lost(None)
    return elapsed / total


def grpc_message(x: np.ndarray) -> bytes:
    """A ModelInferRequest as a gRPC message (its 5-byte prefix included)."""
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name="trivial")
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    data = request.SerializeToString()
    return b"\0" + len(data).to_bytes(4, "big") + data


GRPC_HEADERS = [
    (b":method", b"POST"), (b":scheme", b"http"),
    (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
    (b":authority", b"127.0.0.1:8001"), (b"te", b"trailers"),
    (b"content-type", b"application/grpc"), (b"user-agent", b"grpc-c++/1.60"),
    (b"grpc-accept-encoding", b"identity,deflate,gzip"),
]  # fmt: skip


class GrpcConnection(Connection):
    """An in-memory gRPC client connection: one call at a time; windows opened wide."""

    def __init__(self, run: GrpcRun) -> None:
        asyncio.Transport.__init__(self)
        self.run = run  # type: ignore[assignment]
        self.protocol = GrpcProtocol(run.owner)
        self.protocol.connection_made(self)
        self.closed = False
        encoder = hpack.Encoder()
        first = encoder.encode(GRPC_HEADERS)
        self.block = encoder.encode(GRPC_HEADERS)  # all indexed, as grpc sends them warm
        self.stream_id = 1
        settings = (4).to_bytes(2, "big") + h2.MAX_WINDOW.to_bytes(4, "big")
        self.protocol.data_received(
            h2.PREFACE + h2.frame_head(h2.SETTINGS, 0, 0, 6) + settings
            + h2.frame_head(h2.WINDOW_UPDATE, 0, 0, 4)
            + (h2.MAX_WINDOW - h2.DEFAULT_WINDOW).to_bytes(4, "big")
            + self.call(first)
        )  # fmt: skip

    def call(self, block: bytes) -> bytes:
        message = self.run.request
        sid = self.stream_id
        self.stream_id += 2
        return (
            h2.frame_head(h2.HEADERS, h2.END_HEADERS, sid, len(block)) + block
            + h2.frame_head(h2.DATA, h2.END_STREAM, sid, len(message)) + message
        )  # fmt: skip

    def send(self) -> None:
        if self.run.sent < self.run.total:
            self.run.sent += 1
            self.protocol.data_received(self.call(self.block))

    def writelines(self, parts) -> None:
        for part in parts:
            if part is self.run.ok:  # a call's trailers: it is answered
                self.write(part)


class GrpcRun:
    def __init__(self, owner: GrpcServer, request: bytes, total: int) -> None:
        from serving.grpc.native import _OK_TRAILERS

        self.owner = owner
        self.ok = _OK_TRAILERS
        self.request = request
        self.total = total
        self.sent = self.replies = 0
        self.loop = asyncio.get_running_loop()
        self.done = asyncio.Event()


async def grpc_run(owner: GrpcServer, request: bytes, connections: int, total: int) -> float:
    run = GrpcRun(owner, request, total)
    conns = [GrpcConnection(run) for _ in range(connections)]
    run.sent = connections  # (each connection's first call went with its preface)
    t0 = time.perf_counter()
    await run.done.wait()
    elapsed = time.perf_counter() - t0
    for conn in conns:
        conn.protocol.connection_lost(None)
    return elapsed / total


async def floor_run(server: Server, x: np.ndarray, connections: int, total: int) -> float:
    left = [total]

    async def caller() -> None:
        while left[0] > 0:
            left[0] -= 1
            await server.submit("trivial", {"x": x})

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(connections)))
    return (time.perf_counter() - t0) / total


async def main_async(args) -> None:
    with tempfile.TemporaryDirectory() as root:
        model = pxrt.load(export_trivial(root))
    server = Server()
    server.add_model("trivial", model)
    app = create_app(server)
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    request = binary_request(x)
    owner = GrpcServer(server, max_message_bytes=1 << 20, control=server)
    message = grpc_message(x)
    runs = {
        "floor (submit + await)": lambda: floor_run(server, x, args.connections, args.requests),
        "native": lambda: http_run(app, True, request, args.connections, args.requests),
        "asgi": lambda: http_run(app, False, request, args.connections, args.requests),
        "grpc (pxrt's HTTP/2)": lambda: grpc_run(owner, message, args.connections, args.requests),
    }
    for run in runs.values():  # warm up
        await run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            times[name].append(await run())
    await server.close()
    floor = statistics.median(times["floor (submit + await)"])
    native = statistics.median(times["native"])
    print(f"{args.connections} connections, {args.requests} requests, {args.repeats} repeats")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:24s} {med * 1e6:7.1f} us/request  ({med / floor:.1f}x the floor, "
              f"{med / native:.2f}x native)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loop = new_event_loop()
    try:
        loop.run_until_complete(main_async(args))
    finally:
        loop.close()


if __name__ == "__main__":
    main()
