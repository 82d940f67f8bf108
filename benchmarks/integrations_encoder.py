"""pxrt inside other inference servers on variable-length requests: the demo encoder
(``pxrt.demo.encoder``, its pooled output), one sequence per request, lengths long-tailed
(Pareto on 8..256, most short), against each server's own way to serve the ``jax.jit``
function, alternated in one run.

Each framework's own batching stacks requests of one shape (KServe's Python server has
none; MLServer's adaptive batching and BentoML's ``batchable`` APIs concatenate along
the batch axis, so sequences of different lengths cannot share a batch). What their users
write for such a model is a model that runs each request alone, padded to the next of a
few lengths so that only those are compiled: here the same lengths pxrt's artifact has
(32, 64, 128, 256), each compiled before serving (``jit``). Against it, the framework's
pxrt integration over the exported artifact (``pxrt``; with ``max_delay_us`` 2000),
whose batcher groups the requests by length bucket:

- ``--framework kserve``: ``kserve.ModelServer``, ``PxrtModel``;
- ``--framework mlserver``: ``mlserver start`` (``.venv-mlserver``, which ``make``
  builds), ``PxrtRuntime``; both with ``parallel_workers`` 0;
- for both, ``pxrt`` is the integration's default (REST inference through pxrt's own v2
  endpoint, ``native_v2``) and ``pxrt-predict`` the same model through the framework's
  request objects and the integration's ``predict``;
- ``--framework bentoml``: ``bentoml serve``, ``pxrt_service``: its API (JSON fields)
  and its ``/v2`` mount (pxrt's KServe v2 endpoint).

The load: ``wrk`` (``apt install wrk``), ``--concurrency`` connections posting JSON
bodies in turn from 64 requests of the lengths drawn (the v2 protocol's for KServe,
MLServer and the mount; BentoML's fields for its API), 3 alternated runs; medians.

    python benchmarks/integrations_encoder.py [--framework kserve|mlserver|bentoml] \\
        [--concurrency 64] [--duration 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import integrations as common  # noqa: E402 - (benchmarks/integrations.py: servers, wrk)

LENGTHS = (32, 64, 128, 256)  # the artifact's and the padded jit's


def pooled(params: Any, tokens: Any, mask: Any) -> dict:
    from pxrt import demo

    return {"pooled": demo.encoder(params, tokens, mask)["pooled"]}


class PaddedJit:
    """The ``jax.jit`` encoder run on one request at a time, padded to the next of
    ``LENGTHS`` (each compiled here, for one row)."""

    def __init__(self) -> None:
        import jax

        from pxrt import demo

        params = jax.tree.map(jax.numpy.asarray, demo.make_encoder_params())  # (on the device)
        self.fn = jax.jit(lambda t, m: pooled(params, t, m)["pooled"])
        for length in LENGTHS:
            self.fn(np.zeros((1, length), np.int32), np.zeros((1, length), bool))

    def __call__(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        n, length = tokens.shape
        padded = next(b for b in LENGTHS if b >= length)
        t = np.zeros((n, padded), np.int32)
        m = np.zeros((n, padded), bool)
        t[:, :length], m[:, :length] = tokens, mask
        return np.asarray(self.fn(t, m))


def export_pooled(folder: str) -> str:
    """The demo encoder's pooled output exported to ``folder``/encoder, its lengths
    ``LENGTHS``; returns the artifact's path."""
    import pxrt
    from pxrt import demo

    return pxrt.export(
        pooled, demo.make_encoder_params(), os.path.join(folder, "encoder"),
        inputs=demo.encoder_inputs(), batch_buckets=demo.ENC_BATCH_BUCKETS,
        dim_buckets={"seq": LENGTHS}, name="encoder",
    )  # fmt: skip


def serve_kserve(kind: str, path: str, port: int) -> None:
    import kserve
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

    from serving.integrations.kserve import PxrtModel

    class JitEncoder(kserve.Model):
        def load(self) -> bool:
            self.fn = PaddedJit()
            if os.environ.get("PXRT_BENCH_FREEZE_JIT"):  # (--freeze-baseline)
                from serving.serve import refreeze_gc

                refreeze_gc()
            self.ready = True
            return True

        async def predict(
            self, payload: InferRequest, headers: Any = None, response_headers: Any = None
        ) -> InferResponse:
            inputs = {t.name: t.as_numpy() for t in payload.inputs}
            y = self.fn(inputs["tokens"], inputs["mask"])
            out = InferOutput("pooled", list(y.shape), "FP32")
            out.set_data_from_numpy(y, binary_data=False)
            return InferResponse(payload.id or "", "encoder", [out])

    if kind == "jit":
        served: kserve.Model = JitEncoder("encoder")
    else:  # (pxrt-predict: through PxrtModel.predict, not pxrt's own v2 endpoint)
        served = PxrtModel("encoder", path, native_v2=kind == "pxrt", max_delay_us=2000)
    served.load()
    kserve.ModelServer(http_port=port, enable_grpc=False).start([served])


try:  # (MLServer imports ``integrations_encoder.JitEncoderRuntime``, in its own venv)
    import mlserver as _mls
except ImportError:
    _mls = None

if _mls is not None:
    from mlserver.codecs import NumpyCodec

    class JitEncoderRuntime(_mls.MLModel):
        async def load(self) -> bool:
            self.fn = PaddedJit()
            return True

        async def predict(self, payload: Any) -> Any:
            inputs = {t.name: NumpyCodec.decode_input(t) for t in payload.inputs}
            y = self.fn(inputs["tokens"], inputs["mask"])
            return _mls.types.InferenceResponse(
                model_name=self.name, id=payload.id, outputs=[NumpyCodec.encode_output("pooled", y)]
            )


try:  # (``bentoml serve integrations_encoder:...`` imports this file)
    import bentoml as _bento
except ImportError:
    _bento = None

if _bento is not None and os.environ.get("PXRT_BENCH_ENCODER"):

    @_bento.service(name="encoder")
    class JitEncoderBento:
        def __init__(self) -> None:
            self.fn = PaddedJit()

        @_bento.api
        def predict(self, tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
            return {"pooled": self.fn(tokens.astype(np.int32), mask.astype(bool))}

    from serving.integrations.bentoml import pxrt_service

    PxrtEncoderBento = pxrt_service(os.environ["PXRT_BENCH_ENCODER"], max_delay_us=2000)


def bodies(framework: str, kind: str, n: int = 64) -> list[dict]:
    """``n`` one-sequence requests of long-tailed lengths, as ``kind`` of ``framework``
    reads them."""
    from pxrt import demo

    out = []
    for i, length in enumerate(demo.token_lengths(n, 8, 256, seed=3)):
        req = demo.encoder_request(1, int(length), seed=i)
        tokens, mask = req["tokens"].tolist(), req["mask"].tolist()
        if framework == "bentoml" and kind != "pxrt-v2":
            out.append({"tokens": tokens, "mask": mask})
        else:
            out.append(
                {
                    "inputs": [
                        {"name": "tokens", "datatype": "INT32", "shape": [1, int(length)],
                         "data": tokens[0]},
                        {"name": "mask", "datatype": "BOOL", "shape": [1, int(length)],
                         "data": mask[0]},
                    ]
                }
            )  # fmt: skip
    return out


def start(
    framework: str, kind: str, path: str, port: int, tmp: str, freeze: bool = False
) -> subprocess.Popen:
    env = {**os.environ, "PXRT_BENCH_ENCODER": path}
    if freeze:
        env["PXRT_BENCH_FREEZE_JIT"] = "1"
    if framework == "kserve":
        cmd = [sys.executable, __file__, "--serve", kind, path, "--port", str(port)]
    elif framework == "bentoml":
        service = "JitEncoderBento" if kind == "jit" else "PxrtEncoderBento"
        cmd = [sys.executable, "-m", "bentoml", "serve", f"integrations_encoder:{service}",
               "--working-dir", HERE, "--port", str(port)]  # fmt: skip
    else:
        folder = os.path.join(tmp, f"mlserver-{kind}")
        os.makedirs(os.path.join(folder, "encoder"))
        if kind != "jit":  # (pxrt-predict: through PxrtRuntime.predict)
            extra = {"batching": {"max_delay_us": 2000}, "native_v2": kind == "pxrt"}
            settings: dict = {
                "implementation": "serving.integrations.mlserver.PxrtRuntime",
                "parameters": {"uri": path, "extra": extra},
            }
        else:
            settings = {"implementation": "integrations_encoder.JitEncoderRuntime"}
        with open(os.path.join(folder, "encoder", "model-settings.json"), "w") as f:
            json.dump({"name": "encoder", **settings}, f)
        with open(os.path.join(folder, "settings.json"), "w") as f:
            json.dump({"http_port": port, "grpc_port": 0, "metrics_port": 0,
                       "parallel_workers": 0}, f)  # fmt: skip
        cmd = [common.MLSERVER_BIN, "start", folder]
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{HERE}"
    log = os.path.join(tmp, f"{kind}.log")  # (shown if the server exits)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    proc.stdout_log = log  # type: ignore[attr-defined]
    return proc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("kserve", "mlserver", "bentoml"), default="kserve")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--freeze-baseline",
        action="store_true",
        help="KServe: the jit model's load freezes the garbage collector too, as pxrt's does",
    )
    p.add_argument("--serve", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve_kserve(args.serve[0], args.serve[1], args.port)
        return

    with tempfile.TemporaryDirectory(prefix="pxrt-integrations-") as tmp:
        path = export_pooled(tmp)
        kinds = ("jit", "pxrt") if args.framework == "bentoml" else ("jit", "pxrt", "pxrt-predict")
        ports = common.free_ports(len(kinds))
        procs, urls = [], {}
        ready = common.READY.get(args.framework, "/v2/models/encoder/ready")
        try:
            for kind, port in zip(kinds, ports):
                procs.append(start(args.framework, kind, path, port, tmp, args.freeze_baseline))
                urls[kind] = f"http://127.0.0.1:{port}"
                common.wait_ready(urls[kind] + ready, procs[-1], procs[-1].stdout_log)  # type: ignore[attr-defined]
            infer = "/v2/models/encoder/infer"
            api = "/predict" if args.framework == "bentoml" else infer
            targets = {kind: (urls[kind] + api, bodies(args.framework, kind)) for kind in urls}
            if args.framework == "bentoml":
                targets["pxrt-v2"] = (urls["pxrt"] + infer, bodies("bentoml", "pxrt-v2"))
            print(f"{args.framework}: the demo encoder's pooled output, 1 sequence a request, "
                  f"lengths Pareto on 8..256, {args.concurrency} wrk connections",
                  flush=True)  # fmt: skip
            runs: dict[str, list[dict]] = {k: [] for k in targets}
            for _ in range(args.repeats):
                for kind, (url, docs) in targets.items():
                    runs[kind].append(common._wrk(url, docs, args.concurrency, args.duration))
            common.report(runs, "jit", "jit")
        finally:
            for proc in procs:  # (each server's process group: its workers too)
                common.stop_group(proc)


if __name__ == "__main__":
    main()
