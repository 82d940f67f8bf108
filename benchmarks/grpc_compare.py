"""gRPC against HTTP in one `pxrt serve` process: binary tensors both ways, the same model,
the same server, alternated. The gRPC side is the unmodified `tritonclient.grpc.aio`
client; the HTTP side aiohttp with the binary tensor extension (as `pxrt bench --url`).
The load generator shares the cores with the server. Prints req/s and p50/p99 per run and
the median ratios gRPC / HTTP at each client count.

    python benchmarks/grpc_compare.py [--duration 5] [--clients 1,64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from http_compare import free_port, measure, start  # noqa: E402

from serving.bench.loadgen import closed_loop, run_result  # noqa: E402
from serving.engine.server import new_event_loop  # noqa: E402


def measure_grpc(url: str, clients: int, duration: float) -> dict:
    import tritonclient.grpc.aio as grpcaio

    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)

    async def go() -> dict:
        async with grpcaio.InferenceServerClient(url) as client:
            inp = grpcaio.InferInput("x", [1, 256], "FP32")
            inp.set_data_from_numpy(x)
            infer = functools.partial(client.infer, "mlp", [inp])
            await infer()
            latencies, elapsed, errors = await closed_loop(
                lambda _: infer(), None, clients, duration, count_errors=True
            )
        return run_result(
            "grpc-closed",
            f"gRPC: {clients} clients",
            latencies,
            1,
            elapsed,
            concurrency=clients,
            errors=errors,
        )

    loop = new_event_loop()
    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--clients", default="1,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]

    from pxrt import demo

    tmp = tempfile.mkdtemp(prefix="pxrt-grpc-")
    path = demo.export_demo(os.path.join(tmp, "mlp"))
    port = free_port()
    grpc_port = free_port()
    while grpc_port == port:  # the OS may hand out the same free port twice
        grpc_port = free_port()
    cmd = [sys.executable, "-m", "serving.cli", "serve", path, "--port", str(port)]
    proc = start([*cmd, "--grpc-port", str(grpc_port)], port, dict(os.environ))
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        for _ in range(args.repeats):
            for c in clients:
                runs.setdefault(("http", c), []).append(
                    measure(f"http://127.0.0.1:{port}", True, c, args.duration)
                )
                runs.setdefault(("grpc", c), []).append(
                    measure_grpc(f"127.0.0.1:{grpc_port}", c, args.duration)
                )
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    print(f"\n1-row requests, demo MLP, binary tensors, {args.duration:g} s per run")
    print(f"{'':<6} {'clients':>7} {'req/s':>30} {'p50 ms':>24} {'p99 ms':>24}")
    for (kind, c), rs in runs.items():
        rates = " / ".join(f"{r['requests_per_s']:,.0f}" for r in rs)
        p50s = " / ".join(f"{r['p50_ms']:.2f}" for r in rs)
        p99s = " / ".join(f"{r['p99_ms']:.2f}" for r in rs)
        print(f"{kind:<6} {c:>7} {rates:>30} {p50s:>24} {p99s:>24}")
    print()
    for c in clients:
        g, h = runs[("grpc", c)], runs[("http", c)]
        rate = statistics.median(a["requests_per_s"] / b["requests_per_s"] for a, b in zip(g, h))
        p50 = statistics.median(a["p50_ms"] / b["p50_ms"] for a, b in zip(g, h))
        p99 = statistics.median(a["p99_ms"] / b["p99_ms"] for a, b in zip(g, h))
        print(f"gRPC / HTTP at {c} clients: req/s {rate:.2f}x, p50 {p50:.2f}x, p99 {p99:.2f}x")


if __name__ == "__main__":
    main()
