"""`pxrt serve --workers N` against one process, with a load generator that costs little:
`wrk` (C, one thread, keep-alive connections) posting a binary-tensor infer request to the
trivial model. perf_analyzer needs ~180 us of CPU per request here, a core of this 2-core
machine at the rates measured, so it leaves the server little to scale into; wrk needs a
few us. Configurations take turns; per run: req/s, p50/p99 (wrk's), the server's CPU per
request (all its processes) and how the requests spread over the workers (each worker's
share of the workers' CPU). Needs `wrk` on PATH (Debian: `apt-get install wrk`).

    python benchmarks/workers_scaling.py [--workers 1,2] [--connections 64] [--seconds 5]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import orjson

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from frontend import Served, children, cpu_seconds, export_trivial  # noqa: E402


def wrk_script(path: str) -> str:
    """A wrk Lua script posting one binary-tensor request (16 floats, output binary)."""
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    header = orjson.dumps(
        {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32",
                     "parameters": {"binary_data_size": x.nbytes}}],
         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    )  # fmt: skip
    body = "".join(f"\\{b}" for b in header + x.tobytes())  # Lua's decimal escapes
    script = os.path.join(path, "infer.lua")
    with open(script, "w") as f:
        f.write(
            'wrk.method = "POST"\nwrk.path = "/v2/models/trivial/infer"\n'
            'wrk.headers["Content-Type"] = "application/octet-stream"\n'
            f'wrk.headers["Inference-Header-Content-Length"] = "{len(header)}"\n'
            f'wrk.body = "{body}"\n'
        )
    return script


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def worker_cpu(served: Served) -> list[float]:
    """CPU seconds of each of ``served``'s worker processes."""
    out = []
    for pid in children(served.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"serving.workers.worker" not in f.read():
                    continue
        except FileNotFoundError:
            continue
        out.append(cpu_seconds(pid) - sum(cpu_seconds(c) for c in children(pid)))
    return out


def run_wrk(served: Served, script: str, args) -> dict:
    cmd = ["wrk", "-t1", f"-c{args.connections}", f"-d{round(args.seconds)}s", "--latency",
           "-s", script, served.url("")]  # fmt: skip
    cpu0, n0, w0 = served.cpu_s(), served.requests(), worker_cpu(served)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds + 60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu1, n1, w1 = served.cpu_s(), served.requests(), worker_cpu(served)
    text = done.stdout
    if "Non-2xx" in text or done.returncode:
        raise RuntimeError(f"wrk: {text}{done.stderr}")
    n = max(n1 - n0, 1)
    spread = [b - a for a, b in zip(w0, w1)]
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),  # type: ignore[union-attr]
        "p50_ms": _ms(re.search(r"50%\s+(\S+)", text).group(1)),  # type: ignore[union-attr]
        "p99_ms": _ms(re.search(r"99%\s+(\S+)", text).group(1)),  # type: ignore[union-attr]
        "server_us": (cpu1 - cpu0) / n * 1e6,
        "client_us": ((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime))
        / n
        * 1e6,
        "spread": [round(s / sum(spread), 2) for s in spread] if spread and sum(spread) else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as root:
        path = export_trivial(root)
        script = wrk_script(root)
        servers = [Served(f"workers={n}", path, ["--workers", str(n)]) for n in counts]
        results: dict[str, list[dict]] = {s.name: [] for s in servers}
        try:
            for r in range(args.repeats):
                for served in servers:
                    row = run_wrk(served, script, args)
                    results[served.name].append(row)
                    print(
                        f"run {r + 1} {served.name:10s} {row['rps']:8.0f} req/s  "
                        f"p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms  server "
                        f"{row['server_us']:6.1f} us/req  client {row['client_us']:5.1f} us/req"
                        + (f"  workers' shares {row['spread']}" if row["spread"] else ""),
                        flush=True,
                    )
        finally:
            for served in servers:
                served.stop()
    base = statistics.median(x["rps"] for x in results[servers[0].name])
    print(f"\nmedians, {args.connections} connections, {args.repeats} alternated runs:")
    for name, rows in results.items():
        rps = statistics.median(x["rps"] for x in rows)
        cpu = statistics.median(x["server_us"] for x in rows)
        p99 = statistics.median(x["p99_ms"] for x in rows)
        print(f"  {name:10s} {rps:8.0f} req/s ({rps / base:.2f}x)  p99 {p99:6.2f} ms  "
              f"server {cpu:6.1f} us/req")  # fmt: skip


if __name__ == "__main__":
    main()
