"""pxrt over HTTP (binary and JSON tensors) against the FastAPI baseline, and against pxrt
in-process, all on the same machine, one server at a time, the load generator sharing
the cores. Both servers run with their default options. Prints the ratios for the
closing notes: p50 latency at 1 client, throughput and p99 at 64.

    python benchmarks/http_compare.py [--duration 5] [--clients 1,64]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from serving.bench import http as bench_http  # noqa: E402
from serving.bench import inprocess  # noqa: E402
from serving.engine.server import new_event_loop  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/models/mlp", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{cmd} did not start")


def measure(url: str, binary: bool, clients: int, duration: float) -> dict:
    loop = new_event_loop()
    try:
        target = bench_http.Target(url, "mlp", 1, binary)

        async def go() -> dict:
            async with bench_http._session(1) as session:
                await target.prepare(session)
            return await bench_http.run_closed(target, clients, duration)

        return loop.run_until_complete(go())
    finally:
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--clients", default="1,64", help="concurrent clients, comma-separated")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]

    import pxrt
    from pxrt import demo

    tmp = tempfile.mkdtemp(prefix="pxrt-http-")
    path = demo.export_demo(os.path.join(tmp, "mlp"))
    env = dict(os.environ)
    results = {}

    servers = {
        "pxrt": (["-m", "serving.cli", "serve", path, "--port"], env),
        "baseline": (
            [
                "-m",
                "uvicorn",
                "--app-dir",
                HERE,
                "baseline_fastapi:app",
                "--loop",
                "uvloop",
                "--http",
                "httptools",
                "--log-level",
                "warning",
                "--port",
            ],
            env | {"PXRT_BASELINE_MODEL": path},
        ),
    }
    for name, (argv, server_env) in servers.items():  # one at a time: they share the cores
        port = free_port()
        proc = start([sys.executable, *argv, str(port)], port, server_env)
        try:
            for c in clients:
                for binary in (True, False):
                    results[(f"{name} {'binary' if binary else 'JSON'}", c)] = measure(
                        f"http://127.0.0.1:{port}", binary, c, args.duration
                    )
        finally:
            proc.terminate()
            proc.wait()

    model = pxrt.load(path)
    options = {"max_queue": 1 << 20}
    loop = new_event_loop()
    try:
        for c in clients:
            results[("pxrt in-process", c)] = loop.run_until_complete(
                inprocess.run_closed(model, options, c, 1, args.duration)
            )
    finally:
        loop.close()

    print(
        f"\n1-row requests, demo MLP, {len(model.devices)} device(s), {args.duration:g} s each, "
        "default options"
    )
    print(f"{'':<18} {'clients':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for (k, c), r in results.items():
        print(
            f"{k:<18} {c:>7} {r['requests_per_s']:>9,.0f} {r['p50_ms']:>8.3f} "
            f"{r['p99_ms']:>8.2f} {r.get('errors', 0):>7}"
        )
    print()
    for c in clients:
        for a, b in [
            ("pxrt JSON", "baseline JSON"),
            ("pxrt binary", "baseline binary"),
            ("pxrt binary", "pxrt in-process"),
        ]:
            ra, rb = results[(a, c)], results[(b, c)]
            print(
                f"{c:>3} clients, {a + ' / ' + b + ':':<40} throughput "
                f"{ra['requests_per_s'] / rb['requests_per_s']:>5.2f}x, p50 "
                f"{ra['p50_ms'] / rb['p50_ms']:>5.2f}x, p99 {ra['p99_ms']:.2f} vs "
                f"{rb['p99_ms']:.2f} ms"
            )


if __name__ == "__main__":
    main()
