"""Health checks while large JSON bodies are parsed: `pxrt serve` with one process and with
`--workers 2`, side by side.

A client posts ~10 MB JSON inference requests back to back (their parse holds a front
end's event loop for a while); a prober asks `/v2/health/live` every 20 ms on a new
connection each time (as a load balancer's or Kubernetes' probe does) and records how
long each answer took. With one process every probe that arrives during a parse waits
for it; with workers, a probe is accepted by a worker that is not parsing. Prints the
probes' p50/p99/max per configuration, alternated over repeats.

    python benchmarks/health_under_load.py [--mb 10] [--seconds 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

import httpx
import numpy as np
import orjson

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from frontend import Served, export_trivial  # noqa: E402

CONFIGS = {"one process": [], "--workers 2": ["--workers", "2"]}


def probe(port: int) -> float:
    """One health check on a new connection: seconds to the whole answer."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        while sock.recv(65536):
            pass
    return time.perf_counter() - t0


def measure(served: Served, body: bytes, seconds: float) -> dict:
    stop = threading.Event()
    sent = [0]

    def load() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                r = client.post(served.url("/v2/models/trivial/infer"), content=body,
                                headers={"content-type": "application/json"})  # fmt: skip
                assert r.status_code == 200, r.text[:200]
                sent[0] += 1

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(0.5)
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        latencies.append(probe(served.http))
        time.sleep(0.02)
    stop.set()
    thread.join()
    ms = sorted(x * 1e3 for x in latencies)
    return {
        "p50": statistics.median(ms),
        "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "max": ms[-1],
        "probes": len(ms),
        "bodies": sent[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((100, 16)).astype(np.float32)
    per_row = len(orjson.dumps(sample.ravel().tolist())) / 100  # JSON bytes a row
    rows = int(args.mb * (1 << 20) / per_row)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    body = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "data": x.ravel().tolist(),
                }
            ]
        }  # fmt: skip
    )
    print(f"JSON body: {len(body) / (1 << 20):.1f} MB ({rows} rows)")
    flags = ["--max-queue", str(2 * rows), "--max-json-mb", "64", "--max-body-mb", "64"]
    with tempfile.TemporaryDirectory() as root:
        path = export_trivial(root)
        servers = [Served(name, path, [*CONFIGS[name], *flags]) for name in CONFIGS]
        results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        try:
            for r in range(args.repeats):
                for served in servers:
                    row = measure(served, body, args.seconds)
                    results[served.name].append(row)
                    print(
                        f"run {r + 1} {served.name:12s} health p50 {row['p50']:7.1f} ms  "
                        f"p99 {row['p99']:7.1f} ms  max {row['max']:7.1f} ms  "
                        f"({row['probes']} probes, {row['bodies']} bodies)",
                        flush=True,
                    )
        finally:
            for served in servers:
                served.stop()
    print("\nmedians over runs:")
    for name, rows_ in results.items():
        p99 = statistics.median(x["p99"] for x in rows_)
        p50 = statistics.median(x["p50"] for x in rows_)
        print(f"  {name:12s} health p50 {p50:7.1f} ms  p99 {p99:7.1f} ms")


if __name__ == "__main__":
    main()
