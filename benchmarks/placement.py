"""Placement side by side: one pxrt program sharded over all devices, instances of the
model each on one device (replicated), the default load (``placement="auto"``, measured
afresh: every load here is cold, in a cache of its own), pxrt on one device, and what a
user writes without pxrt: a plain asyncio batcher running ``jax.jit``'s compiled buckets
on one device (``serving.bench.baselines.PlainBatcher``). Closed loop, 1-row requests, alternated
rounds, medians.

Models: a held-out-style MLP (256 -> 1024 -> 1024 -> 256, gelu; buckets 1, 8, 64) and
the demo encoder (1-row requests of 32 tokens, a compiled length).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/placement.py \
        [--callers 64] [--duration 3] [--repeats 3] [--model mlp|encoder|both]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import sys
import tempfile

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402
from serving import Server  # noqa: E402
from serving.bench.baselines import PlainBatcher  # noqa: E402
from serving.bench.loadgen import closed_loop  # noqa: E402


def mlp(params, x):
    for w, b in params:
        x = jax.nn.gelu(x @ w + b)
    return {"y": x}


def mlp_params(seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    dims = (256, 1024, 1024, 256)
    return [
        (
            (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            np.zeros(b, np.float32),
        )
        for a, b in zip(dims, dims[1:])
    ]


def export(root: str, which: str) -> tuple[str, dict]:
    if which == "mlp":
        path = pxrt.export(
            mlp,
            mlp_params(),
            os.path.join(root, "mlp"),
            inputs={"x": pxrt.TensorSpec((256,), "float32")},
            batch_buckets=(1, 8, 64),
            name="mlp",
        )
        return path, {"x": np.ones((1, 256), np.float32)}
    path = demo.export_encoder(os.path.join(root, "encoder"))
    return path, demo.encoder_request(
        1, 32, seed=0
    )  # a lane length: the plain batcher pads rows only


async def measure(path: str, request: dict, callers: int, duration: float, repeats: int) -> None:
    # Every load cold, in a cache of this run's own: each cell timed at its load with
    # nothing else running (a warm load's times are an earlier run's, and the server
    # times them again only while it is quiet: here, while the plain batcher runs).
    with tempfile.TemporaryDirectory() as cache:
        one = pxrt.load(path, devices=jax.devices()[:1], compilation_cache=cache)
        loaded = {
            how: pxrt.load(path, placement=how, compilation_cache=cache)
            for how in ("sharded", "replicated")
        }
        loaded["auto"] = pxrt.load(path, compilation_cache=cache)  # the default
    print(f"auto: {loaded['auto'].placement_reason}")
    rates: dict[str, list[float]] = {}
    p50: dict[str, list[float]] = {}
    async with Server() as server:
        alts = {}
        for how, model in loaded.items():
            server.add_model(how, model)
            alts[f"pxrt {how}"] = functools.partial(server.infer, how)
        server.add_model("replicated-1", loaded["replicated"], max_inflight=1)
        alts["pxrt replicated, 1 in flight each"] = functools.partial(server.infer, "replicated-1")
        plain = PlainBatcher(one)
        alts["plain, 1 device"] = plain.infer
        server.add_model("one", one)
        alts["pxrt, 1 device"] = functools.partial(server.infer, "one")
        names = list(alts)
        for infer in alts.values():  # warm up
            await closed_loop(infer, request, callers, 0.2)
        for rep in range(repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                lat, elapsed, _ = await closed_loop(alts[name], request, callers, duration)
                rates.setdefault(name, []).append(len(lat) / elapsed)
                p50.setdefault(name, []).append(float(np.median(lat)) * 1e3)
        plain.close()
    base = statistics.median(rates["plain, 1 device"])
    print(f"{'':<34} {'req/s':>9} {'/ plain':>8} {'p50 ms':>8}")
    for name in names:
        r = statistics.median(rates[name])
        print(f"{name:<34} {r:>9,.0f} {r / base:>7.2f}x {statistics.median(p50[name]):>8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--callers", type=int, default=64)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", choices=("mlp", "encoder", "both"), default="both")
    args = p.parse_args()
    print(
        f"{jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} cores, "
        f"{args.callers} callers, {args.duration} s x {args.repeats} alternated rounds"
    )
    with tempfile.TemporaryDirectory() as root:
        for which in ("mlp", "encoder") if args.model == "both" else (args.model,):
            print(f"\n## {which}")
            path, request = export(root, which)
            asyncio.run(measure(path, request, args.callers, args.duration, args.repeats))


if __name__ == "__main__":
    main()
