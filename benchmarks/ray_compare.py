"""pxrt inside Ray Serve against what a Ray user writes without it: a deployment with
``@serve.batch`` around a ``jax.jit`` call (every batch size 1..64 compiled and warmed in
its constructor, so nothing compiles while measured). The demo MLP, 1-row requests, 64
closed-loop callers, 1 and 2 replicas of each, all deployed at once on one local Ray and
measured alternately:

- ``handle``: Python callers in the driver, ``await handle.infer.remote({"x": x})``, and
  for pxrt also through a ``PxrtHandle``;
- ``http``: KServe v2 JSON through Ray's HTTP proxy (aiohttp callers).

``--model encoder``: the demo encoder on long-tailed lengths instead (handle mode), against
``@serve.batch`` padding each batch to length 256 and 1, 8 or 32 rows.

Prints req/s and p50/p99 per run and the median ratios pxrt / @serve.batch. The callers,
Ray's proxy and the replicas share this machine's cores.

    python benchmarks/ray_compare.py [--duration 5] [--repeats 3] [--clients 64]
    python benchmarks/ray_compare.py --model encoder
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import ray  # noqa: E402
from ray import serve  # noqa: E402

from pxrt import demo  # noqa: E402
from serving.bench.loadgen import closed_loop, run_result  # noqa: E402
from serving.ray import PxrtHandle, pxrt_app  # noqa: E402

MAX_BATCH = 64


@serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
class JitBatch:
    """The baseline: the model's function under jax.jit, requests gathered by
    ``@serve.batch`` (KServe v2 JSON over HTTP too, as a Ray user would add)."""

    def __init__(self, wait_s: float) -> None:
        import jax

        self.params = demo.make_params()
        self.fn = jax.jit(demo.mlp)
        for n in range(1, MAX_BATCH + 1):  # compiled up front: none while serving
            self.fn(self.params, np.zeros((n, demo.WIDTH), np.float32))["y"].block_until_ready()
        self.infer.set_batch_wait_timeout_s(wait_s)

    @serve.batch(max_batch_size=MAX_BATCH)
    async def infer(self, requests: list[dict]) -> list[dict]:
        x = np.concatenate([r["x"] for r in requests])
        y = np.asarray(self.fn(self.params, x)["y"])
        out, start = [], 0
        for r in requests:
            n = len(r["x"])
            out.append({"y": y[start : start + n]})
            start += n
        return out

    async def __call__(self, request) -> dict:
        import orjson
        from starlette.responses import Response

        doc = orjson.loads(await request.body())
        (inp,) = doc["inputs"]
        x = np.asarray(inp["data"], np.float32).reshape(inp["shape"])
        y = (await self.infer({"x": x}))["y"]
        body = {"model_name": "mlp", "outputs": [
            {"name": "y", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}
        ]}  # fmt: skip
        return Response(orjson.dumps(body), media_type="application/json")


@serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
class JitEncoderBatch:
    """The baseline for the encoder (``--model encoder``): what a careful Ray user writes
    for variable lengths: each batch padded to the longest length served (256) and to a
    batch size of 1, 8 or 32, all three shapes compiled in the constructor."""

    SIZES = (1, 8, 32)

    def __init__(self, wait_s: float) -> None:
        import jax

        self.params = demo.make_encoder_params()
        self.fn = jax.jit(demo.encoder)
        self.top = max(demo.ENC_SEQ_BUCKETS)
        for n in self.SIZES:
            tokens = np.zeros((n, self.top), np.int32)
            self.fn(self.params, tokens, tokens > 0)["pooled"].block_until_ready()
        self.infer.set_batch_wait_timeout_s(wait_s)

    @serve.batch(max_batch_size=32)
    async def infer(self, requests: list[dict]) -> list[dict]:
        rows = sum(len(r["tokens"]) for r in requests)
        size = next(n for n in self.SIZES if n >= rows)
        tokens = np.zeros((size, self.top), np.int32)
        mask = np.zeros((size, self.top), np.bool_)
        start = 0
        for r in requests:
            n, length = r["tokens"].shape
            tokens[start : start + n, :length] = r["tokens"]
            mask[start : start + n, :length] = r["mask"]
            start += n
        out = self.fn(self.params, tokens, mask)
        hidden, pooled = np.asarray(out["hidden"]), np.asarray(out["pooled"])
        answers, start = [], 0
        for r in requests:
            n, length = r["tokens"].shape
            answers.append(
                {"hidden": hidden[start : start + n, :length], "pooled": pooled[start : start + n]}
            )
            start += n
        return answers


def encoder_requests(n: int = 512) -> list[dict]:
    """1-row requests with long-tailed lengths (Pareto on 8..256, median ~14)."""
    return [
        demo.encoder_request(1, int(length), seed=i)
        for i, length in enumerate(demo.token_lengths(n, 8, 256, seed=0))
    ]


def deploy(path: str, wait_s: float, model: str = "mlp", **pxrt_options: float) -> dict[str, str]:
    """Every system and replica count as its own application; name -> route prefix."""
    apps = {}
    for replicas in (1, 2):
        name = f"pxrt-{replicas}"
        app = pxrt_app(path, num_replicas=replicas, ray_actor_options={"num_cpus": 0},
                       max_batch_size=MAX_BATCH if model == "mlp" else 32,
                       **pxrt_options)  # fmt: skip
        serve.run(app, name=name, route_prefix=f"/{name}")
        apps[name] = f"/{name}"
        name = f"batch-{replicas}"
        baseline = JitBatch if model == "mlp" else JitEncoderBatch
        app = baseline.options(num_replicas=replicas).bind(wait_s)
        serve.run(app, name=name, route_prefix=f"/{name}")
        apps[name] = f"/{name}"
    return apps


async def measure_handle(
    name: str, clients: int, duration: float, coalesce: bool, model: str = "mlp"
) -> dict:
    handle = serve.get_app_handle(name)
    if model == "mlp":
        x = np.random.default_rng(0).standard_normal((1, demo.WIDTH)).astype(np.float32)
        request: dict | list = {"x": x}
    else:
        request = encoder_requests()
    infer = PxrtHandle(handle).infer if coalesce else handle.infer.remote
    for r in (request if isinstance(request, list) else [request])[:3]:
        await infer(r)
    latencies, elapsed, errors = await closed_loop(
        infer, request, clients, duration, count_errors=True
    )
    label = f"{name} (PxrtHandle)" if coalesce else name
    return run_result("handle", label, latencies, 1, elapsed, errors=errors)


async def measure_http(url: str, name: str, clients: int, duration: float) -> dict:
    import aiohttp
    import orjson

    x = np.random.default_rng(0).standard_normal((1, demo.WIDTH)).astype(np.float32)
    body = orjson.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, demo.WIDTH], "data": x.ravel().tolist()}
    ]})  # fmt: skip
    target = url + (f"/{name}/v2/models/mlp/infer" if name.startswith("pxrt") else f"/{name}")
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def infer(_):
            async with session.post(target, data=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{name}: HTTP {r.status}")

        await infer(None)
        latencies, elapsed, errors = await closed_loop(
            infer, None, clients, duration, count_errors=True
        )
    return run_result("http", name, latencies, 1, elapsed, errors=errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--wait-ms", type=float, default=2.0,
                        help="@serve.batch's batch_wait_timeout_s, in ms (default 2)")  # fmt: skip
    parser.add_argument("--delay-us", type=float, default=0.0,
                        help="pxrt's max_delay_us (default 0)")  # fmt: skip
    parser.add_argument("--max-inflight", type=int, default=2,
                        help="pxrt's max_inflight (default 2)")  # fmt: skip
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--modes", default="handle,http")
    parser.add_argument(
        "--model", choices=("mlp", "encoder"), default="mlp",
        help="encoder: the demo encoder on long-tailed lengths (handle mode only)",
    )  # fmt: skip
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="pxrt-ray-")
    if args.model == "mlp":
        path = demo.export_demo(os.path.join(work, "mlp"))
    else:
        path = demo.export_encoder(os.path.join(work, "encoder"))
        args.modes = "handle"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    try:
        apps = deploy(
            path, args.wait_ms / 1e3, args.model,
            max_delay_us=args.delay_us, max_inflight=args.max_inflight,
        )  # fmt: skip
        rows = []
        loop = asyncio.new_event_loop()
        for mode in args.modes.split(","):
            for rep in range(args.repeats):
                runs = [(name, False) for name in apps]
                if mode == "handle":
                    runs += [(name, True) for name in apps if name.startswith("pxrt")]
                for name, coalesce in runs:
                    if mode == "handle":
                        row = loop.run_until_complete(
                            measure_handle(name, args.clients, args.duration, coalesce, args.model)
                        )
                    else:
                        row = loop.run_until_complete(
                            measure_http(url, name, args.clients, args.duration)
                        )
                    row["repeat"] = rep
                    rows.append(row)
                    print(
                        f"{mode:<6} {row['label']:<20} rep {rep}: {row['rows_per_s']:>8.0f} req/s  "
                        f"p50 {row['p50_ms']:6.1f} ms  p99 {row['p99_ms']:6.1f} ms  "
                        f"errors {row['errors']}",
                        flush=True,
                    )
        print("\nmedian ratios pxrt / @serve.batch (req/s; p99 of @serve.batch / pxrt):")
        for mode in args.modes.split(","):
            for replicas in (1, 2):
                base = [r for r in rows if r["mode"] == mode and r["label"] == f"batch-{replicas}"]
                for label in (f"pxrt-{replicas}", f"pxrt-{replicas} (PxrtHandle)"):
                    mine = [r for r in rows if r["mode"] == mode and r["label"] == label]
                    if not mine:
                        continue
                    rate = statistics.median(
                        a["rows_per_s"] / b["rows_per_s"] for a, b in zip(mine, base)
                    )
                    p99 = statistics.median(b["p99_ms"] / a["p99_ms"] for a, b in zip(mine, base))
                    print(f"  {mode:<6} {label:<24} req/s {rate:.2f}x, p99 {p99:.2f}x lower")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
