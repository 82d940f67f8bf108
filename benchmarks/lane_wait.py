"""The lanes' wait bound, on and off: a model with named dimensions under a long-tailed
length mix, its tail latency with and without the bound, alternated in one process.

While a batch runs, the batcher sends only a lane that fills its batch, or one whose
oldest request has waited as long as the lane's own batch takes to run (or
``max_delay_us``): ``Batcher._lane_wait_s``. "off" sets those bounds to infinity, the
batcher before it, where a lane few requests take waited for the pipeline to empty.

The demo encoder's pooled output (batch buckets 1/8/32 x seq 32/64/128/256), 1-row
requests with Pareto lengths on 8..256 (64 fixed requests taken in turn), ``--callers``
closed-loop callers of ``serving.Server.infer``, ``--repeats`` alternated runs of
``--duration`` s; the p99 of all requests and of those longer than 128 tokens.

    python benchmarks/lane_wait.py [--max-delay-us 0] [--duration 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402


async def run(server, requests, seconds: float, callers: int) -> dict:
    latencies: list[tuple[int, float]] = []
    stop = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        k = i
        while time.perf_counter() < stop:
            inputs, length = requests[k % len(requests)]
            k += 7
            start = time.perf_counter()
            await server.infer("encoder", inputs)
            latencies.append((length, time.perf_counter() - start))

    await asyncio.gather(*(caller(i) for i in range(callers)))
    every = np.array([t for _, t in latencies]) * 1e3
    long = np.array([t for n, t in latencies if n > 128]) * 1e3
    return {
        "requests_per_s": len(latencies) / seconds,
        "p50_ms": float(np.percentile(every, 50)),
        "p99_ms": float(np.percentile(every, 99)),
        "long_p99_ms": float(np.percentile(long, 99)) if len(long) else math.nan,
    }


async def main(args: argparse.Namespace) -> None:
    from integrations_encoder import export_pooled

    from serving import Server

    with tempfile.TemporaryDirectory(prefix="pxrt-lane-wait-") as tmp:
        path = export_pooled(tmp)
        lengths = demo.token_lengths(64, 8, 256, seed=3)
        requests = [
            (demo.encoder_request(1, int(n), seed=i), int(n)) for i, n in enumerate(lengths)
        ]
        async with Server() as server:
            server.add_model("encoder", pxrt.load(path), max_delay_us=args.max_delay_us)
            batcher = server._batchers["encoder"]  # (the A/B switch: its bounds)
            bounds = list(batcher._lane_wait_s)
            await run(server, requests, 2.0, args.callers)  # (warm-up)
            runs: dict[str, list[dict]] = {"on": [], "off": []}
            for _ in range(args.repeats):
                for mode in runs:
                    on = mode == "on"
                    batcher._lane_wait_s = bounds if on else [math.inf] * len(bounds)
                    runs[mode].append(await run(server, requests, args.duration, args.callers))
                    print(mode, {k: round(v, 1) for k, v in runs[mode][-1].items()}, flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    print(f"on / off (medians of {args.repeats}, max_delay_us {args.max_delay_us:g}): " + ", ".join(
        f"{k} {med['on'][k] / med['off'][k]:.2f}x" for k in med["on"]
    ))  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-delay-us", type=float, default=0.0)
    p.add_argument("--callers", type=int, default=64)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(p.parse_args()))
