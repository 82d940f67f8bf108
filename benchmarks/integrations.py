"""pxrt inside other inference servers against each server's own way to serve a
``jax.jit`` function, alternated in one run (``serving.integrations``).

KServe: its Python model server (``kserve.ModelServer``) twice, in processes of their
own on this machine, serving the same model as ``mlp``:

- ``jit``: what KServe's docs have a user write: a ``kserve.Model`` whose async
  ``predict`` calls the ``jax.jit`` function on each request's tensor (compiled for the
  request's row count before serving). KServe's Python server has no batching of its
  own (its batcher is the Kubernetes agent's sidecar, outside this process): each
  request runs alone, as KServe runs it;
- ``pxrt``: ``serving.integrations.kserve.PxrtModel`` over the exported artifact, its
  requests batched by pxrt.

The load: ``pxrt bench --url JIT --compare PXRT`` (KServe v2 binary tensors over HTTP,
``--concurrency`` closed-loop callers of one row each, the two alternated ``--repeats``
times; ratios pxrt / jit with 95% intervals).

LitServe (``--framework litserve``): ``litserve.LitServer`` twice, the same way:

- ``batch``: LitServe's documented batching: a ``LitAPI`` with ``max_batch_size`` 64
  and ``batch_timeout`` (``--batch-timeout-ms``, 1 ms by default) whose ``predict``
  runs the ``jax.jit`` function on the requests stacked (every batch size 1..64
  compiled in ``setup``, so nothing compiles while measured);
- ``pxrt``: ``serving.integrations.litserve.PxrtLitAPI``.

The load: ``--concurrency`` asyncio callers posting one-row JSON to ``/predict`` back to
back (``serving.bench.loadgen``), the two alternated ``--repeats`` times; medians.

The model: the demo MLP at ``--width`` (1024 by default).

    python benchmarks/integrations.py [--framework kserve|litserve] [--width 1024] \\
        [--concurrency 64] [--duration 5] [--repeats 3]

Also ``--serve jit|pxrt PATH --port P``: one of the two servers (what the run starts).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def serve(kind: str, path: str, port: int, width: int) -> None:
    import jax
    import kserve
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

    from pxrt import demo
    from serving.integrations.kserve import PxrtModel

    class JitModel(kserve.Model):
        """KServe's documented custom model: load the function, predict per request."""

        def load(self) -> bool:
            params = demo.make_params(width=width)
            self.fn = jax.jit(lambda x: demo.mlp(params, x)["y"])
            self.fn(np.zeros((1, width), np.float32)).block_until_ready()  # (1-row requests)
            self.ready = True
            return True

        def get_input_types(self) -> list[dict]:
            return [{"name": "x", "datatype": "FP32", "shape": [-1, width]}]

        def get_output_types(self) -> list[dict]:
            return [{"name": "y", "datatype": "FP32", "shape": [-1, width]}]

        async def predict(
            self, payload: InferRequest, headers: Any = None, response_headers: Any = None
        ) -> InferResponse:
            y = np.asarray(self.fn(payload.inputs[0].as_numpy()))
            binary = payload.use_binary_outputs
            out = InferOutput("y", list(y.shape), "FP32")
            out.set_data_from_numpy(y, binary_data=binary)
            return InferResponse(payload.id or "", "mlp", [out], use_binary_outputs=binary)

    served = PxrtModel("mlp", path) if kind == "pxrt" else JitModel("mlp")
    served.load()
    kserve.ModelServer(http_port=port, enable_grpc=False).start([served])


try:  # (LitServe's workers are spawned: its API classes live at module level)
    import litserve as _ls
except ImportError:
    _ls = None

if _ls is not None:

    class JitBatch(_ls.LitAPI):
        """LitServe's documented batching around the ``jax.jit`` function."""

        def __init__(self, width: int, **options: Any) -> None:
            super().__init__(**options)
            self.width = width

        def setup(self, device: Any) -> None:
            import jax

            from pxrt import demo

            params = demo.make_params(width=self.width)
            self.fn = jax.jit(lambda x: demo.mlp(params, x)["y"])
            for n in range(1, 65):  # (every batch size compiled before serving)
                self.fn(np.zeros((n, self.width), np.float32)).block_until_ready()

        def decode_request(self, request):  # noqa: ANN001, ANN201 - LitServe reads it
            return np.asarray(request["inputs"]["x"], np.float32)

        def batch(self, inputs: list) -> np.ndarray:
            return np.concatenate(inputs)

        def predict(self, x: np.ndarray) -> np.ndarray:
            return np.asarray(self.fn(x))

        def unbatch(self, y: np.ndarray) -> list:
            return [y[i : i + 1] for i in range(len(y))]

        def encode_response(self, y: np.ndarray) -> dict:
            return {"outputs": {"y": y.tolist()}}


def serve_litserve(kind: str, path: str, port: int, width: int, timeout_ms: float) -> None:
    import litserve as ls

    from serving.integrations.litserve import PxrtLitAPI

    if kind == "pxrt":
        api: Any = PxrtLitAPI(path)
    else:
        api = JitBatch(width, max_batch_size=64, batch_timeout=timeout_ms / 1e3)
    # (fast_queue: ZeroMQ between the API server and the worker, LitServe's faster transport)
    ls.LitServer(api, accelerator="cpu", fast_queue=True).run(port=port, generate_client_file=False)


async def _post_loop(url: str, width: int, concurrency: int, duration: float) -> dict:
    import httpx

    from serving.bench.loadgen import closed_loop, run_result

    body = {"inputs": {"x": np.full((1, width), 0.5, np.float32).tolist()}}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def infer(b: dict) -> None:
            r = await client.post(url, json=b)
            r.raise_for_status()

        latencies, elapsed, _ = await closed_loop(infer, body, concurrency, duration)
    return run_result("http", url, latencies, 1, elapsed)


def compare_litserve(urls: dict, args: argparse.Namespace) -> None:
    import asyncio
    import statistics

    runs: dict[str, list[dict]] = {k: [] for k in urls}
    for _ in range(args.repeats):
        for kind, url in urls.items():
            runs[kind].append(
                asyncio.run(_post_loop(f"{url}/predict", args.width, int(args.concurrency),
                                       args.duration))
            )  # fmt: skip
    med = {
        kind: {
            k: statistics.median(r[k] for r in rs) for k in ("requests_per_s", "p50_ms", "p99_ms")
        }
        for kind, rs in runs.items()
    }
    for kind, m in med.items():
        each = ", ".join(f"{r['requests_per_s']:.0f}" for r in runs[kind])
        print(f"  {kind:6s} {m['requests_per_s']:8.0f} req/s  p50 {m['p50_ms']:7.2f} ms  "
              f"p99 {m['p99_ms']:7.2f} ms  (runs: {each})")  # fmt: skip
    b, p = med["batch"], med["pxrt"]
    rate = p["requests_per_s"] / b["requests_per_s"]
    p50, p99 = p["p50_ms"] / b["p50_ms"], p["p99_ms"] / b["p99_ms"]
    print(f"  pxrt / LitServe batching: req/s {rate:.2f}x, p50 {p50:.2f}x, p99 {p99:.2f}x")


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server at {url} exited")
        try:
            ready = "/health" if "litserve" in proc.args else "/v2/models/mlp/ready"
            if httpx.get(f"{url}{ready}", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the server at {url} did not become ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("kserve", "litserve"), default="kserve")
    p.add_argument("--width", type=int, default=1024, help="the demo MLP's width")
    p.add_argument("--batch-timeout-ms", type=float, default=1.0, help="LitServe's batching")
    p.add_argument("--concurrency", default="64")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        if args.framework == "litserve":
            serve_litserve(
                args.serve[0], args.serve[1], args.port, args.width, args.batch_timeout_ms
            )
        else:
            serve(args.serve[0], args.serve[1], args.port, args.width)
        return

    from pxrt import demo

    with tempfile.TemporaryDirectory(prefix="pxrt-integrations-") as tmp:
        path = demo.export_demo(os.path.join(tmp, "mlp"), width=args.width)
        sockets = [socket.socket() for _ in range(2)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
        for s in sockets:
            s.close()
        procs, urls = [], []
        try:
            kinds = ("jit", "pxrt") if args.framework == "kserve" else ("batch", "pxrt")
            for kind, port in zip(kinds, ports):
                cmd = [sys.executable, __file__, "--serve", kind, path, "--port", str(port),
                       "--width", str(args.width), "--framework", args.framework,
                       "--batch-timeout-ms", str(args.batch_timeout_ms)]  # fmt: skip
                procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL,
                                              start_new_session=True))  # fmt: skip
                urls.append(f"http://127.0.0.1:{port}")
                wait_ready(urls[-1], procs[-1])
            print(f"{args.framework} {_version(args.framework)}: {kinds[0]} at {urls[0]}, pxrt "
                  f"at {urls[1]}; the demo MLP, width {args.width}, 1-row requests, "
                  f"{args.concurrency} callers", flush=True)  # fmt: skip
            if args.framework == "litserve":
                compare_litserve(dict(zip(kinds, urls)), args)
                return
            subprocess.run(
                [sys.executable, "-m", "serving.cli", "bench", "--url", urls[0],
                 "--compare", urls[1], "--model", "mlp", "--concurrency", args.concurrency,
                 "--duration", str(args.duration), "--repeats", str(args.repeats)],
                cwd=ROOT, check=True,
            )  # fmt: skip
        finally:
            for proc in procs:  # (each server's process group: LitServe's workers too)
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


if __name__ == "__main__":
    main()
