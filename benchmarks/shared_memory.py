"""System shared memory against binary HTTP for large inputs, with Triton's own client.

``pxrt serve`` runs a model whose one input is 1 MB or 16 MB of float32 and whose output
is 64 numbers (so the input's transfer is what differs). One client (tritonclient.http,
one request at a time) sends each request either as binary HTTP (the tensor's bytes in
the body) or through a registered region (the client writes the tensor into its segment,
then sends a request that names it), the two taking turns in rounds. Reported per size:
p50 latency and the server's CPU time per request (its process's user + system time over
the round, from /proc), shared memory against binary.

    python benchmarks/shared_memory.py [--duration 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import jax.numpy as jnp  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402

import pxrt  # noqa: E402

SIZES = {"in_1mb": 1 << 18, "in_16mb": 1 << 22}  # float32 elements: 1 MB, 16 MB


def chunk_sums(params, x):
    return {"y": x.reshape(x.shape[0], 64, -1).sum(-1) * params["scale"]}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(client, name: str, x: np.ndarray, handle, shared: bool, duration: float, pid: int):
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    if shared:
        inp.set_shared_memory(name, x.nbytes)
    lat = []
    cpu0, end = cpu_seconds(pid), time.perf_counter() + duration
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        if shared:
            shm.set_shared_memory_region(handle, [x])
        else:
            inp.set_data_from_numpy(x, binary_data=True)
        client.infer(name, [inp])
        lat.append(time.perf_counter() - t0)
    cpu = cpu_seconds(pid) - cpu0
    return float(np.percentile(lat, 50)) * 1e3, cpu / len(lat) * 1e6, len(lat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8517)
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="pxrt-shm-")
    paths = []
    for name, n in SIZES.items():
        paths.append(os.path.join(tmp, name))
        pxrt.export(
            chunk_sums, {"scale": jnp.float32(0.5)}, paths[-1], name=name,
            inputs={"x": pxrt.TensorSpec((n,), "float32")}, batch_buckets=(1,),
        )  # fmt: skip
    server = subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "serve", *paths, "--port", str(args.port),
         "--max-body-mb", "64", "--allow-client-shm"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = httpclient.InferenceServerClient(f"127.0.0.1:{args.port}")
    handles = []
    try:
        for _ in range(600):
            try:
                if client.is_server_ready():
                    break
            except Exception:  # noqa: BLE001, S110 - not up yet
                pass
            time.sleep(0.2)
        print(f"{'input':8} {'round':>5} {'p50 ms shm/bin':>22} {'server us/req shm/bin':>28}")
        for name, n in SIZES.items():
            x = np.random.default_rng(0).standard_normal((1, n)).astype(np.float32)
            key = f"/pxrt-bench-{name}"
            handle = shm.create_shared_memory_region(name, key, x.nbytes)
            handles.append(handle)
            client.register_system_shared_memory(name, key, x.nbytes)
            y_bin = client.infer(name, [_binary(x)]).as_numpy("y")
            shm.set_shared_memory_region(handle, [x])
            shared_in = httpclient.InferInput("x", list(x.shape), "FP32")
            shared_in.set_shared_memory(name, x.nbytes)
            y_shm = client.infer(name, [shared_in]).as_numpy("y")
            np.testing.assert_array_equal(y_bin, y_shm)  # the same answer either way
            p50s, cpus = [], []
            for r in range(args.rounds):
                s = run(client, name, x, handle, True, args.duration, server.pid)
                b = run(client, name, x, handle, False, args.duration, server.pid)
                p50s.append(s[0] / b[0])
                cpus.append(s[1] / b[1])
                print(
                    f"{name:8} {r:>5} {s[0]:7.2f} / {b[0]:7.2f} = {p50s[-1]:4.2f}x "
                    f"{s[1]:8.0f} / {b[1]:8.0f} = {cpus[-1]:4.2f}x"
                )
            print(
                f"{name:8}   all p50 {statistics.median(p50s):.2f}x "
                f"({min(p50s):.2f}-{max(p50s):.2f}), server CPU "
                f"{statistics.median(cpus):.2f}x ({min(cpus):.2f}-{max(cpus):.2f})"
            )
            client.unregister_system_shared_memory(name)
    finally:
        client.close()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
        server.terminate()
        server.wait(30)


def _binary(x: np.ndarray):
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return inp


if __name__ == "__main__":
    main()
