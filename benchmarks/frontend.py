"""The network front end measured as Triton users measure servers: Triton's own C++ load
generator, perf_analyzer (binary tensors, closed loop at a fixed concurrency), against
`pxrt serve` configurations that run side by side and take turns (the order rotating
each repeat), on a trivial model (y = 2x + 1 over 16 floats) whose device work is small,
so what is measured is the front end. Per run: req/s and p50/p99 (perf_analyzer's), the
server's CPU per request (its process CPU over the requests it counted) and the client's;
then the medians and the ratios against the first configuration.

    python benchmarks/frontend.py [--configs asgi,native] [--protocols http,grpc]
        [--concurrency 64] [--repeats 3] [--interval-ms 3000]

A config ``native@/path/to/other/checkout`` runs ``native`` from another tree: a change
measured against the tree before it, in one run.

perf_analyzer comes with Triton's client tools (``pip install perf-analyzer`` where its
wheel's glibc matches); give its command with ``--perf-analyzer`` or
``PXRT_PERF_ANALYZER`` (default: ``perf_analyzer`` on PATH).
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # servers.children

from http_compare import free_port  # noqa: E402
from servers import children  # noqa: E402

import pxrt  # noqa: E402

# name -> extra `pxrt serve` flags
CONFIGS = {
    "asgi": ["--no-native-http"],  # every request through the Starlette app
    "native": [],  # the defaults: HTTP from the parser's callbacks, gRPC on pxrt's HTTP/2
    "grpcio": ["--no-native-grpc"],  # gRPC with grpcio's asyncio server
    "workers2": ["--workers", "2"],  # two front-end processes and the device process
}


def trivial(params, x):
    return {"y": x * params["a"] + params["b"]}


def export_trivial(root: str) -> str:
    return pxrt.export(
        trivial,
        {"a": np.float32(2), "b": np.float32(1)},
        os.path.join(root, "trivial"),
        inputs={"x": pxrt.TensorSpec((16,), "float32")},
        batch_buckets=(1, 8, 64, 256),
        name="trivial",
    )


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system), with its live children's (a
    `pxrt serve --workers N` process and its workers)."""
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


class Served:
    """One `pxrt serve` process (HTTP and gRPC ports) and its counters. A config named
    ``NAME@DIR`` runs config NAME from another checkout of pxrt at DIR (its extensions
    built in place: ``python setup.py build_ext --inplace``), to compare two trees."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        config, _, tree = name.partition("@")
        flags = CONFIGS[config]
        env = dict(os.environ)
        if tree:
            env["PYTHONPATH"] = os.path.abspath(tree)
        self.http, self.grpc = free_port(), free_port()
        cmd = [sys.executable, "-m", "serving.cli", "serve", path, "--port", str(self.http),
               "--grpc-port", str(self.grpc), *flags]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=tree or ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _ in range(1200):
            try:
                if httpx.get(self.url("/v2/health/ready"), timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"pxrt serve {shlex.join(flags)} did not start")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http}{path}"

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def requests(self) -> int:
        doc = httpx.get(self.url("/v2/models/trivial/stats"), timeout=10).json()
        return doc["model_stats"][0]["inference_stats"]["success"]["count"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def perf_analyzer(pa: list[str], served: Any, protocol: str, args, strict: bool = True) -> dict:
    """One perf_analyzer run against ``served``; ``strict=False``: its CPU figures even
    when perf_analyzer ends with an error after measuring (no latency figures then)."""
    port = served.http if protocol == "http" else served.grpc
    with tempfile.NamedTemporaryFile(suffix=".csv") as out:
        cmd = [*pa, "-m", "trivial", "-i", protocol, "-u", f"127.0.0.1:{port}",
               "--concurrency-range", f"{args.concurrency}:{args.concurrency}",
               "--measurement-interval", str(args.interval_ms),
               "--stability-percentage", str(args.stability), "-f", out.name,
               *shlex.split(args.pa_args)]  # fmt: skip
        cpu0, n0 = served.cpu_s(), served.requests()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu1, n1 = served.cpu_s(), served.requests()
        if done.returncode != 0 and strict:
            raise RuntimeError(f"perf_analyzer failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        with open(out.name) as f:
            row = next(csv.DictReader(f), None)
    n = max(n1 - n0, 1)
    client_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    result = {
        "server_us": (cpu1 - cpu0) / n * 1e6,
        "client_us": client_s / n * 1e6,
    }
    if row is not None:
        result.update(
            rps=float(row["Inferences/Second"]),
            p50_ms=float(row["p50 latency"]) / 1e3,
            p99_ms=float(row["p99 latency"]) / 1e3,
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="asgi,native")
    parser.add_argument("--protocols", default="http")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval-ms", type=int, default=3000)
    parser.add_argument(
        "--stability", type=int, default=25, help="perf_analyzer's stability percentage: "
        "its last 3 windows agree within this (its default, 10, is rarely met on 2 shared cores)",
    )  # fmt: skip
    parser.add_argument(
        "--perf-analyzer", default=os.environ.get("PXRT_PERF_ANALYZER", "perf_analyzer")
    )
    parser.add_argument(
        "--pa-args", default="", help="more perf_analyzer arguments, e.g. "
        "'-b 256 --input-tensor-format json' (256-row requests as JSON: the parse is the work)",
    )  # fmt: skip
    args = parser.parse_args()
    pa = shlex.split(args.perf_analyzer)
    configs = args.configs.split(",")
    protocols = args.protocols.split(",")
    with tempfile.TemporaryDirectory() as root:
        path = export_trivial(root)
        servers = [Served(c, path) for c in configs]
        results: dict[tuple[str, str], list[dict]] = {}
        try:
            for r in range(args.repeats):
                # The order rotates each repeat: a configuration always measured first
                # came out 3-5% slower than the same tree measured second.
                turn = servers[r % len(servers) :] + servers[: r % len(servers)]
                for protocol in protocols:
                    for served in turn:
                        row = perf_analyzer(pa, served, protocol, args)
                        results.setdefault((served.name, protocol), []).append(row)
                        print(
                            f"run {r + 1} {protocol:4s} {served.name:8s} {row['rps']:8.0f} req/s  "
                            f"p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms  "
                            f"server {row['server_us']:6.1f} us/req  "
                            f"client {row['client_us']:5.1f} us/req",
                            flush=True,
                        )
        finally:
            for served in servers:
                served.stop()
    print(f"\nmedians, {args.concurrency} concurrent, {args.repeats} alternated runs:")
    keys = ("rps", "p50_ms", "p99_ms", "server_us", "client_us")
    for protocol in protocols:
        base = {k: statistics.median(x[k] for x in results[(configs[0], protocol)]) for k in keys}
        for config in configs:
            med = {k: statistics.median(x[k] for x in results[(config, protocol)]) for k in keys}
            ratios = "  ".join(f"{k} {med[k] / base[k]:.2f}x" for k in keys)
            values = "  ".join(f"{k} {med[k]:.1f}" for k in keys)
            print(f"{protocol:4s} {config:8s} {values}\n{'':14s}vs {configs[0]}: {ratios}")


if __name__ == "__main__":
    main()
