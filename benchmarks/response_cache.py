"""The response cache on a workload where half the requests repeat, in one process.

Closed-loop callers send single-row requests to a model served with and without
``response_cache``, taking turns. Half of the requests are drawn from a small pool of
popular ones (each sent before: a hit once the cache holds it), half are new; a second
workload repeats nothing, so the cache's cost (a BLAKE2b digest of every request, a
lookup, a copy of every answer kept) shows against no cache at all. Two models: the
demo MLP (the device's share small) and a wide one (the device's share large).

    python benchmarks/response_cache.py [--duration 2] [--repeats 3] [--callers 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402
from serving import Server  # noqa: E402
from serving.bench.loadgen import closed_loop  # noqa: E402
from serving.loops import new_event_loop  # noqa: E402

POPULAR = 256  # the pool repeats are drawn from


def workload(model: pxrt.Model, n: int, repeat: float, seed: int = 0) -> list[dict]:
    """``n`` single-row requests: a share ``repeat`` of them from the popular pool."""
    rng = np.random.default_rng(seed)
    (name, spec), = model.inputs.items()  # fmt: skip
    fresh = rng.standard_normal((n, 1, *spec.shape)).astype(spec.dtype)
    pool = rng.standard_normal((POPULAR, 1, *spec.shape)).astype(spec.dtype)
    picks = rng.integers(0, POPULAR, n)
    repeats = rng.random(n) < repeat
    return [{name: pool[picks[i]] if repeats[i] else fresh[i]} for i in range(n)]


async def run_once(model: pxrt.Model, cache: bool, requests: list, args) -> dict:
    async with Server() as server:
        server.add_model("m", model, response_cache=cache)
        lat, elapsed, _ = await closed_loop(
            lambda r: server.infer("m", r), requests, args.callers, args.duration
        )
        snap = server.metrics_snapshot()["m"]
    ms = np.asarray(lat) * 1e3
    hits = snap.get("response_cache", {}).get("hits", 0)
    return {
        "req_s": len(lat) / elapsed,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "hit_rate": hits / max(1, len(lat)),
        "wrapped": len(lat) > len(requests),
    }


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "demo MLP": pxrt.load(demo.export_demo(os.path.join(tmp, "mlp"), buckets=(1, 8, 32))),
            "wide MLP (1024 x 6)": pxrt.load(
                demo.export_demo(
                    os.path.join(tmp, "wide"), buckets=(1, 8, 32), width=1024, layers=6
                )
            ),
        }
        rows = []
        for label, model in models.items():
            for repeat in (0.5, 0.0):
                requests = workload(model, args.requests, repeat)
                await run_once(model, True, requests[:2000], args)  # warm up
                runs: dict[bool, list[dict]] = {True: [], False: []}
                for rep in range(args.repeats):
                    for cache in (True, False) if rep % 2 == 0 else (False, True):
                        runs[cache].append(await run_once(model, cache, requests, args))
                rows.append((label, repeat, runs))

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    print(
        f"\n{args.callers} closed-loop callers, one-row requests, medians of {args.repeats} "
        f"alternated runs of {args.duration:g} s each way, {len(jax_devices())} device(s)"
    )
    print(
        f"{'model':<20} {'repeats':>7} {'cache':>5} {'req/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'hits':>5}   on/off: req/s  p50   p99"
    )
    for label, repeat, runs in rows:
        on, off = runs[True], runs[False]
        for cache, rs in ((True, on), (False, off)):
            ratio = ""
            if cache:
                ratio = (
                    f"   {med(on, 'req_s') / med(off, 'req_s'):>11.2f}x "
                    f"{med(on, 'p50_ms') / med(off, 'p50_ms'):.2f}x "
                    f"{med(on, 'p99_ms') / med(off, 'p99_ms'):.2f}x"
                )
            print(
                f"{label:<20} {repeat:>7.0%} {'on' if cache else 'off':>5} "
                f"{med(rs, 'req_s'):>9,.0f} {med(rs, 'p50_ms'):>7.2f} {med(rs, 'p99_ms'):>7.2f} "
                f"{med(rs, 'hit_rate'):>5.0%}{ratio}"
            )
        if any(r["wrapped"] for r in on + off):
            print(f"  ({label}: a run went through all {args.requests} requests; raise --requests)")


def jax_devices() -> list:
    import jax

    return jax.devices()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args()
    loop = new_event_loop()
    try:
        loop.run_until_complete(main(args))
    finally:
        loop.close()
