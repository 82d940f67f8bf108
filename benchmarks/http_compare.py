"""pxrt over HTTP (binary and JSON tensors) against the FastAPI baseline, and against pxrt
in-process, all on the same machine, one server at a time, the load generator sharing
the cores. Prints the ratios for the closing notes.

    python benchmarks/http_compare.py [--duration 5] [--clients 64]
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

from serving import bench, bench_http  # noqa: E402
from serving.server import new_event_loop  # noqa: E402


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
    parser.add_argument("--clients", type=int, default=64)
    args = parser.parse_args()

    import pxrt
    from pxrt import demo

    tmp = tempfile.mkdtemp(prefix="pxrt-http-")
    path = demo.export_demo(os.path.join(tmp, "mlp"))
    env = dict(os.environ)
    results = {}

    servers = {
        "pxrt": (["-m", "serving.cli", "serve", path, "--max-batch-size", "64", "--port"], env),
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
            for binary in (True, False):
                results[f"{name} {'binary' if binary else 'JSON'}"] = measure(
                    f"http://127.0.0.1:{port}", binary, args.clients, args.duration
                )
        finally:
            proc.terminate()
            proc.wait()

    model = pxrt.load(path)
    options = {
        "max_batch_size": 64,
        "max_delay_us": 2000.0,
        "max_queue": 1 << 20,
        "max_inflight": 2,
    }
    loop = new_event_loop()
    try:
        results["pxrt in-process"] = loop.run_until_complete(
            bench.run_closed(model, options, args.clients, 1, args.duration)
        )
    finally:
        loop.close()

    print(
        f"\n{args.clients} concurrent clients, 1-row requests, demo MLP, "
        f"{len(model.devices)} device(s), {args.duration:g} s each"
    )
    print(f"{'':<18} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for k, r in results.items():
        print(
            f"{k:<18} {r['requests_per_s']:>9,.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r.get('errors', 0):>7}"
        )
    rps = {k: r["requests_per_s"] for k, r in results.items()}
    p99 = {k: r["p99_ms"] for k, r in results.items()}
    print()
    for a, b in [
        ("pxrt binary", "baseline JSON"),
        ("pxrt binary", "baseline binary"),
        ("pxrt JSON", "baseline JSON"),
        ("pxrt binary", "pxrt in-process"),
    ]:
        print(
            f"{a + ' / ' + b + ' throughput:':<46} {rps[a] / rps[b]:>6.2f}x   "
            f"p99 {p99[a]:.2f} vs {p99[b]:.2f} ms"
        )


if __name__ == "__main__":
    main()
