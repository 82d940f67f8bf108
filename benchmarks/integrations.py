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
  requests batched by pxrt; its REST inference answered by pxrt's own v2 endpoint
  (``native_v2``, the default) or, with ``--no-native``, through KServe's ``predict``.

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

BentoML (``--framework bentoml``): ``bentoml serve`` twice, one worker each:

- ``batch``: BentoML's adaptive batching as its docs show it: a service whose API is
  ``batchable`` (``max_batch_size`` 64, ``max_latency_ms`` 1000: a bound; BentoML's
  dispatcher picks the wait itself) and runs the ``jax.jit`` function on the requests
  stacked (every batch size 1..64 compiled in the constructor);
- ``pxrt``: ``serving.integrations.bentoml.pxrt_service`` over the artifact: its
  ``/predict`` API, and (``pxrt-v2``) its mount of pxrt's KServe v2 endpoint, the same
  rows as v2 JSON tensors.

The load: as LitServe's, the body ``{"x": rows}``.

MLServer (``--framework mlserver``, from ``.venv-mlserver``, which ``make`` builds: it
cannot share a venv with KServe): ``mlserver start`` twice, one inference worker each:

- ``batch``: MLServer's adaptive batching, as its docs set it in ``model-settings.json``
  (``max_batch_size`` 64, ``max_batch_time`` ``--batch-timeout-ms``), around a custom
  runtime (``mlserver.MLModel``) whose ``predict`` runs the ``jax.jit`` function on the
  batch MLServer merged (every batch size 1..64 compiled in ``load``);
- ``pxrt``: ``serving.integrations.mlserver.PxrtRuntime``, MLServer's batching unset, on
  MLServer's own loop (``parallel_workers`` 0, ``--pxrt-workers``); REST inference
  through pxrt's own v2 endpoint (``native_v2``, the default; ``--no-native``: through
  its ``predict``).

The load: as KServe's, ``pxrt bench --url --json`` (MLServer's REST reads JSON tensors).

For LitServe and BentoML the callers are ``wrk`` where it is installed (``apt install
wrk``: C, one thread, ``--concurrency`` connections, latencies from its ``--latency``
percentiles): a Python client on these two cores costs more CPU per request than either
server and caps both at the same rate. ``--client python`` uses the asyncio callers.

The model: the demo MLP at ``--width`` (1024 by default).

    python benchmarks/integrations.py [--framework kserve|litserve|bentoml] [--width 1024] \\
        [--concurrency 64] [--duration 5] [--repeats 3]

Also ``--serve jit|pxrt PATH --port P``: one of the two servers (what the run starts).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
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


def serve(kind: str, path: str, port: int, width: int, native: bool) -> None:
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

    if kind == "pxrt":
        served: Any = PxrtModel("mlp", path, native_v2=native)
    else:
        served = JitModel("mlp")
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


try:  # (``bentoml serve integrations:JitBento`` imports this file to find its services)
    import bentoml as _bento
except ImportError:
    _bento = None

if _bento is not None and os.environ.get("PXRT_BENCH_ARTIFACT"):
    _WIDTH = int(os.environ["PXRT_BENCH_WIDTH"])

    @_bento.service(name="mlp")
    class JitBento:
        """BentoML's adaptive batching around the ``jax.jit`` function."""

        def __init__(self) -> None:
            import jax

            from pxrt import demo

            params = demo.make_params(width=_WIDTH)
            self.fn = jax.jit(lambda x: demo.mlp(params, x)["y"])
            for n in range(1, 65):  # (every batch size compiled before serving)
                self.fn(np.zeros((n, _WIDTH), np.float32)).block_until_ready()

        @_bento.api(batchable=True, max_batch_size=64, max_latency_ms=1000)
        def predict(self, x: np.ndarray) -> np.ndarray:
            return np.asarray(self.fn(x.astype(np.float32)))

    from serving.integrations.bentoml import pxrt_service

    PxrtBento = pxrt_service(os.environ["PXRT_BENCH_ARTIFACT"], max_delay_us=2000)


try:  # (MLServer imports ``integrations.JitRuntime`` from this file, in its own venv)
    import mlserver as _mls
except ImportError:
    _mls = None

if _mls is not None:
    from mlserver.codecs import NumpyCodec

    class JitRuntime(_mls.MLModel):
        """MLServer's documented custom runtime around the ``jax.jit`` function."""

        async def load(self) -> bool:
            import jax

            from pxrt import demo

            width = self.settings.parameters.extra["width"]
            params = demo.make_params(width=width)
            self.fn = jax.jit(lambda x: demo.mlp(params, x)["y"])
            for n in range(1, 65):  # (every batch size compiled before serving)
                self.fn(np.zeros((n, width), np.float32)).block_until_ready()
            return True

        async def predict(self, payload: Any) -> Any:
            y = np.asarray(self.fn(NumpyCodec.decode_input(payload.inputs[0])))
            return _mls.types.InferenceResponse(
                model_name=self.name, id=payload.id, outputs=[NumpyCodec.encode_output("y", y)]
            )


MLSERVER_BIN = os.path.join(ROOT, ".venv-mlserver", "bin", "mlserver")


def mlserver_folder(
    root: str, kind: str, path: str, width: int, timeout_ms: float, native: bool = True
) -> str:
    """A model repository for ``mlserver start``: ``kind``'s model-settings.json
    (``native``: PxrtRuntime's ``native_v2``)."""
    import json

    folder = os.path.join(root, f"mlserver-{kind}")
    os.makedirs(os.path.join(folder, "mlp"))
    if kind == "pxrt":
        settings: dict = {
            "implementation": "serving.integrations.mlserver.PxrtRuntime",
            "parameters": {"uri": path, "extra": {"native_v2": native}},
        }
    else:  # (MLServer's adaptive batching, in seconds)
        settings = {
            "implementation": "integrations.JitRuntime",
            "max_batch_size": 64,
            "max_batch_time": timeout_ms / 1e3,
            "parameters": {"extra": {"width": width}},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, width]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, width]}],
        }
    with open(os.path.join(folder, "mlp", "model-settings.json"), "w") as f:
        json.dump({"name": "mlp", **settings}, f)
    return folder


def serve_litserve(kind: str, path: str, port: int, width: int, timeout_ms: float) -> None:
    import litserve as ls

    from serving.integrations.litserve import PxrtLitAPI

    if kind == "pxrt":
        api: Any = PxrtLitAPI(path)
    else:
        api = JitBatch(width, max_batch_size=64, batch_timeout=timeout_ms / 1e3)
    # (fast_queue: ZeroMQ between the API server and the worker, LitServe's faster transport)
    ls.LitServer(api, accelerator="cpu", fast_queue=True).run(port=port, generate_client_file=False)


async def _post_loop(url: str, body: dict, concurrency: int, duration: float) -> dict:
    import httpx

    from serving.bench.loadgen import closed_loop, run_result

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def infer(b: dict) -> None:
            r = await client.post(url, json=b)
            r.raise_for_status()

        latencies, elapsed, _ = await closed_loop(infer, body, concurrency, duration)
    return run_result("http", url, latencies, 1, elapsed)


def _wrk(url: str, body: dict | list[dict], concurrency: int, duration: float) -> dict:
    """``wrk`` posting ``body`` (or each of a list of bodies in turn) as JSON over
    ``concurrency`` connections for ``duration`` s."""
    import json
    import re

    bodies = body if isinstance(body, list) else [body]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        texts = ",\n".join(f"[==[{json.dumps(b)}]==]" for b in bodies)
        script.write(
            f"local bodies = {{{texts}}}\nlocal i = 0\n"
            "local headers = {['Content-Type'] = 'application/json'}\n"
            "request = function()\n  i = i % #bodies + 1\n"
            "  return wrk.format('POST', nil, headers, bodies[i])\nend\n"
        )
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{concurrency}", f"-d{duration:g}s", "--latency", "--timeout",
             "30s", "-s", script.name, url],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    finally:
        os.unlink(script.name)
    if "Non-2xx" in out or "Socket errors" in out:
        raise SystemExit(f"wrk saw errors from {url}:\n{out}")
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}

    def percentile(p: str) -> float:
        value, unit = re.search(rf"\s{p}%\s+([\d.]+)(us|ms|s)\b", out).groups()  # type: ignore[union-attr]
        return float(value) * scale[unit]

    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return {"requests_per_s": rate, "p50_ms": percentile("50"), "p99_ms": percentile("99")}


def compare_json(urls: dict, args: argparse.Namespace) -> None:
    """LitServe's or BentoML's two servers driven with one-row JSON, alternated (and
    BentoML's pxrt service's /v2 mount with the same rows as v2 JSON)."""
    import asyncio

    rows = np.full((1, args.width), 0.5, np.float32).tolist()
    body = {"inputs": {"x": rows}} if args.framework == "litserve" else {"x": rows}
    targets = {kind: (f"{url}/predict", body) for kind, url in urls.items()}
    if args.framework == "bentoml":
        v2 = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, args.width],
                          "data": rows[0]}]}  # fmt: skip
        targets["pxrt-v2"] = (f"{urls['pxrt']}/v2/models/mlp/infer", v2)

    runs: dict[str, list[dict]] = {k: [] for k in targets}
    for _ in range(args.repeats):
        for kind, (url, doc) in targets.items():
            n = int(args.concurrency)
            if args.client == "wrk":
                runs[kind].append(_wrk(url, doc, n, args.duration))
            else:
                runs[kind].append(asyncio.run(_post_loop(url, doc, n, args.duration)))
    name = "LitServe" if args.framework == "litserve" else "BentoML"
    report(runs, "batch", f"{name} batching")


def report(runs: dict[str, list[dict]], base: str, label: str) -> None:
    """Each kind's medians over its runs, then each one's ratios to ``base``'s."""
    import statistics

    keys = ("requests_per_s", "p50_ms", "p99_ms")
    med = {kind: {k: statistics.median(r[k] for r in rs) for k in keys}
           for kind, rs in runs.items()}  # fmt: skip
    for kind, m in med.items():
        each = ", ".join(f"{r['requests_per_s']:.0f}" for r in runs[kind])
        print(f"  {kind:12s} {m['requests_per_s']:8.0f} req/s  p50 {m['p50_ms']:7.2f} ms  "
              f"p99 {m['p99_ms']:7.2f} ms  (runs: {each})")  # fmt: skip
    b = med[base]
    for kind, m in med.items():
        if kind != base:
            rate = m["requests_per_s"] / b["requests_per_s"]
            print(f"  {kind} / {label}: req/s {rate:.2f}x, p50 {m['p50_ms'] / b['p50_ms']:.2f}x, "
                  f"p99 {m['p99_ms'] / b['p99_ms']:.2f}x")  # fmt: skip


def free_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1 now."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to a server's process group (its workers too), then SIGKILL to the rest."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


#: The readiness path of the frameworks that do not answer the v2 protocol's model ready.
READY = {"litserve": "/health", "bentoml": "/readyz"}


def wait_ready(url: str, proc: subprocess.Popen, log: str | None = None) -> None:
    """Until ``url`` (a readiness URL) answers 200; a server that exits first (its
    output's end from ``log``, where there is one) or takes over 4 minutes ends the run."""
    import httpx

    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            output = ""
            if log is not None:
                with open(log) as f:
                    output = ":\n" + f.read()[-3000:]
            raise SystemExit(f"the server for {url} exited{output}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not become ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("kserve", "litserve", "bentoml", "mlserver"),
                   default="kserve")  # fmt: skip
    p.add_argument("--width", type=int, default=1024, help="the demo MLP's width")
    p.add_argument("--batch-timeout-ms", type=float, default=1.0,
                   help="LitServe's and MLServer's batching")  # fmt: skip
    p.add_argument(
        "--jit-workers",
        type=int,
        default=1,
        help="MLServer's parallel_workers for the jit runtime (its default: 1)",
    )
    p.add_argument(
        "--pxrt-workers",
        type=int,
        default=0,
        help="MLServer's parallel_workers for PxrtRuntime (0: on MLServer's loop)",
    )
    p.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KServe's PxrtModel, MLServer's PxrtRuntime: native_v2 (pxrt's own v2 endpoint)",
    )
    p.add_argument("--concurrency", default="64")  # fmt: skip
    p.add_argument("--client", choices=("wrk", "python"),
                   default="wrk" if shutil.which("wrk") else "python",
                   help="LitServe's and BentoML's callers")  # fmt: skip
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
            serve(args.serve[0], args.serve[1], args.port, args.width, args.native)
        return

    from pxrt import demo

    with tempfile.TemporaryDirectory(prefix="pxrt-integrations-") as tmp:
        path = demo.export_demo(os.path.join(tmp, "mlp"), width=args.width)
        ports = free_ports(2)
        procs, urls = [], []
        try:
            kinds = ("jit", "pxrt") if args.framework == "kserve" else ("batch", "pxrt")
            if args.framework == "mlserver" and not os.path.exists(MLSERVER_BIN):
                raise SystemExit("no .venv-mlserver: `make all` builds it")
            env = {**os.environ, "PXRT_BENCH_ARTIFACT": path, "PXRT_BENCH_WIDTH": str(args.width)}
            for kind, port in zip(kinds, ports):
                cmd = [sys.executable, __file__, "--serve", kind, path, "--port", str(port),
                       "--width", str(args.width), "--framework", args.framework,
                       "--batch-timeout-ms", str(args.batch_timeout_ms),
                       "--native" if args.native else "--no-native"]  # fmt: skip
                if args.framework == "bentoml":  # (as its users start it; the flag is for us)
                    service = "JitBento" if kind == "batch" else "PxrtBento"
                    cmd = [sys.executable, "-m", "bentoml", "serve", f"integrations:{service}",
                           "--working-dir", HERE, "--port", str(port)]  # fmt: skip
                if args.framework == "mlserver":  # (ports in the repository's settings.json)
                    folder = mlserver_folder(
                        tmp, kind, path, args.width, args.batch_timeout_ms, args.native
                    )
                    workers = args.pxrt_workers if kind == "pxrt" else args.jit_workers
                    with open(os.path.join(folder, "settings.json"), "w") as f:
                        f.write(f'{{"http_port": {port}, "grpc_port": 0, "metrics_port": 0, '
                                f'"parallel_workers": {workers}}}')  # fmt: skip
                    cmd = [MLSERVER_BIN, "start", folder]
                    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{HERE}"
                procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, env=env,
                                              start_new_session=True))  # fmt: skip
                urls.append(f"http://127.0.0.1:{port}")
                wait_ready(urls[-1] + READY.get(args.framework, "/v2/models/mlp/ready"), procs[-1])
            client = "pxrt bench" if args.framework in ("kserve", "mlserver") else args.client
            print(f"{args.framework} {_version(args.framework)}: {kinds[0]} at {urls[0]}, pxrt "
                  f"at {urls[1]}; the demo MLP, width {args.width}, 1-row requests, "
                  f"{args.concurrency} callers ({client})", flush=True)  # fmt: skip
            if args.framework in ("litserve", "bentoml"):
                compare_json(dict(zip(kinds, urls)), args)
                return
            json_tensors = ["--json"] if args.framework == "mlserver" else []
            subprocess.run(
                [sys.executable, "-m", "serving.cli", "bench", "--url", urls[0],
                 "--compare", urls[1], "--model", "mlp", "--concurrency", args.concurrency,
                 "--duration", str(args.duration), "--repeats", str(args.repeats),
                 *json_tensors],
                cwd=ROOT, check=True,
            )  # fmt: skip
        finally:
            for proc in procs:  # (each server's process group: LitServe's workers too)
                stop_group(proc)


def _version(name: str) -> str:
    import importlib.metadata

    if name == "mlserver":
        out = subprocess.run([MLSERVER_BIN, "--version"], capture_output=True, text=True).stdout
        return out.split()[-1]
    return importlib.metadata.version(name)


if __name__ == "__main__":
    main()
