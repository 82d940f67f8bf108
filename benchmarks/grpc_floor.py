"""What grpcio itself costs per ModelInfer: a server on grpcio's generic handlers that
answers every ModelInfer with a canned response (raw bytes in and out, no protobuf
parse, no pxrt), its other methods forwarded to a real `pxrt serve`, measured with
perf_analyzer side by side with that `pxrt serve`'s own gRPC, alternated. The floor's
server CPU per request is what no servicer on grpcio can go below.

    python benchmarks/grpc_floor.py [--repeats 3] [--concurrency 64] [--perf-analyzer CMD]

    (run as a floor server: python benchmarks/grpc_floor.py --serve sync|aio PORT UPSTREAM)
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from frontend import Served, cpu_seconds, export_trivial, perf_analyzer  # noqa: E402
from http_compare import free_port  # noqa: E402

INFER = "/inference.GRPCInferenceService/ModelInfer"


def serve_floor(mode: str, port: int, upstream: str, count_file: str) -> None:
    import asyncio
    import concurrent.futures

    import grpc

    channel = grpc.insecure_channel(upstream)
    canned: dict[str, bytes] = {}
    count = [0]

    def forward(method: str, request: bytes) -> bytes:
        return channel.unary_unary(method)(request)

    def counted() -> None:
        count[0] += 1
        if count[0] % 500 == 0:
            with open(count_file, "w") as f:
                f.write(str(count[0]))

    def answer(method: str, request: bytes) -> bytes:
        if method != INFER:
            return forward(method, request)
        counted()
        if INFER not in canned:
            canned[INFER] = forward(method, request)
        return canned[INFER]

    class Sync(grpc.GenericRpcHandler):
        def service(self, details):
            method = details.method
            return grpc.unary_unary_rpc_method_handler(lambda r, _: answer(method, r))

    class Aio(grpc.GenericRpcHandler):
        def service(self, details):
            method = details.method

            async def handler(request: bytes, _) -> bytes:
                if method == INFER and INFER in canned:
                    counted()
                    return canned[INFER]
                return await asyncio.to_thread(answer, method, request)

            return grpc.unary_unary_rpc_method_handler(handler)

    if mode == "sync":
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(8), handlers=[Sync()])
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
    else:

        async def main() -> None:
            server = grpc.aio.server(handlers=[Aio()])
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await server.wait_for_termination()

        asyncio.run(main())


class Floor:
    """A floor server (``serve_floor`` in a subprocess), measured as ``frontend.Served``."""

    def __init__(self, mode: str, upstream: Served) -> None:
        self.name = f"grpcio {mode} floor"
        self.http = upstream.http
        self.grpc = free_port()
        self.count_file = tempfile.mktemp(prefix="pxrt-floor-")
        self.upstream = upstream
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                mode,
                str(self.grpc),
                f"127.0.0.1:{upstream.grpc}",
                self.count_file,
            ]  # fmt: skip
        )
        time.sleep(3)

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def requests(self) -> int:
        try:
            with open(self.count_file) as f:
                return int(f.read() or 0)
        except FileNotFoundError:
            return 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", nargs=4, metavar=("MODE", "PORT", "UPSTREAM", "COUNT_FILE"))
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval-ms", type=int, default=3000)
    parser.add_argument("--stability", type=int, default=25)
    parser.add_argument(
        "--perf-analyzer", default=os.environ.get("PXRT_PERF_ANALYZER", "perf_analyzer")
    )
    args = parser.parse_args()
    if args.serve:
        mode, port, upstream, count_file = args.serve
        serve_floor(mode, int(port), upstream, count_file)
        return
    pa = shlex.split(args.perf_analyzer)
    with tempfile.TemporaryDirectory() as root:
        served = Served("pxrt", export_trivial(root), [])
        targets = [served, Floor("sync", served), Floor("aio", served)]
        results: dict[str, list[dict]] = {t.name: [] for t in targets}
        try:
            for r in range(args.repeats):
                for target in targets:
                    # perf_analyzer ends with an error against a floor (its statistics,
                    # forwarded, count none of the canned answers), after measuring.
                    row = perf_analyzer(pa, target, "grpc", args, strict=target is served)
                    results[target.name].append(row)
                    print(f"run {r + 1} {target.name:18s} server {row['server_us']:6.1f} us/req  "
                          f"client {row['client_us']:5.1f} us/req", flush=True)  # fmt: skip
        finally:
            for target in reversed(targets):
                target.stop()
    print(f"\nmedian server CPU per request, gRPC, {args.concurrency} concurrent:")
    for name, rows in results.items():
        if rows:
            print(f"  {name:18s} {statistics.median(r['server_us'] for r in rows):6.1f} us")


if __name__ == "__main__":
    main()
