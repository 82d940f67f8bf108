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
times; ratios pxrt / jit with 95% intervals). The model: the demo MLP at ``--width``
(1024 by default).

    python benchmarks/integrations.py [--width 1024] [--concurrency 64] \\
        [--duration 5] [--repeats 3]

Also ``--serve jit|pxrt PATH --port P``: one of the two servers (what the run starts).
"""

from __future__ import annotations

import argparse
import os
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


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server at {url} exited")
        try:
            if httpx.get(f"{url}/v2/models/mlp/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the server at {url} did not become ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024, help="the demo MLP's width")
    p.add_argument("--concurrency", default="64")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
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
            for kind, port in zip(("jit", "pxrt"), ports):
                cmd = [sys.executable, __file__, "--serve", kind, path, "--port", str(port),
                       "--width", str(args.width)]  # fmt: skip
                procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL))  # fmt: skip
                urls.append(f"http://127.0.0.1:{port}")
                wait_ready(urls[-1], procs[-1])
            print(f"KServe {_version()}: jit at {urls[0]}, pxrt at {urls[1]}; the demo MLP, "
                  f"width {args.width}, 1-row requests", flush=True)  # fmt: skip
            subprocess.run(
                [sys.executable, "-m", "serving.cli", "bench", "--url", urls[0],
                 "--compare", urls[1], "--model", "mlp", "--concurrency", args.concurrency,
                 "--duration", str(args.duration), "--repeats", str(args.repeats)],
                cwd=ROOT, check=True,
            )  # fmt: skip
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(30)


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("kserve")


if __name__ == "__main__":
    main()
