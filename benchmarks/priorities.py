"""Request priorities (Triton's ``priority`` parameter) under saturation, in one process.

A model served with ``max_batch_size`` 8 is saturated by closed-loop callers of level-2
requests (``--saturating`` of them: the queue always holds several batches' worth);
beside them one caller sends a level-1 request every few milliseconds and measures its
latency. The same traffic runs against the model served with ``priority_levels=2``
(level 1 goes first) and with ``priority_levels=1`` (no priorities: every request in
arrival order), taking turns; the table shows each one's medians over the repeats, the
ratio of the level-1 p99s, and the throughput both served (priorities must not cost any).

    python benchmarks/priorities.py [--duration 2] [--repeats 3] [--saturating 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402
from serving import Server  # noqa: E402
from serving.bench.loadgen import closed_loop  # noqa: E402
from serving.loops import new_event_loop  # noqa: E402


async def run_once(
    model: pxrt.Model, levels: int, saturating: int, duration: float, interval: float
) -> dict:
    request = pxrt.example_inputs(model.inputs, 1, seed=0)
    async with Server() as server:
        server.add_model("m", model, max_batch_size=8, priority_levels=levels)
        background = asyncio.ensure_future(
            closed_loop(
                lambda r: server.infer("m", r, priority=levels), request, saturating, duration
            )  # fmt: skip
        )
        await asyncio.sleep(0.2)  # the queue fills
        latencies = []
        stop = time.perf_counter() + duration - 0.4
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await server.infer("m", request, priority=1)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(interval)
        lat, elapsed, _ = await background
    ms = np.asarray(latencies) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "level2_req_s": len(lat) / elapsed,
        "level2_p50_ms": float(np.median(lat)) * 1e3,
        "count": len(ms),
    }


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = pxrt.load(demo.export_demo(os.path.join(tmp, "mlp"), buckets=(1, 8)))
        runs: dict[str, list[dict]] = {"levels 2": [], "levels 1": []}
        await run_once(model, 2, args.saturating, 0.6, args.interval)  # warm up
        for rep in range(args.repeats):
            for name in ["levels 2", "levels 1"] if rep % 2 == 0 else ["levels 1", "levels 2"]:
                levels = int(name.split()[1])
                runs[name].append(
                    await run_once(model, levels, args.saturating, args.duration, args.interval)
                )

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    print(
        f"\n{args.saturating} callers of level-2 requests saturate the demo MLP "
        f"(max_batch_size 8, {len(model.devices)} device(s)); one level-1 request every "
        f"{args.interval * 1e3:g} ms; medians of {args.repeats} alternated runs of "
        f"{args.duration:g} s"
    )
    print(f"{'served with':<18} {'level-1 p50 ms':>14} {'p99 ms':>8} {'level-2 req/s':>14} "
          f"{'level-2 p50 ms':>15}")  # fmt: skip
    for name, label in (("levels 2", "priority_levels 2"), ("levels 1", "no priorities")):
        p50, p99 = med(name, "p50_ms"), med(name, "p99_ms")
        rate, p50_2 = med(name, "level2_req_s"), med(name, "level2_p50_ms")
        print(f"{label:<18} {p50:>14.2f} {p99:>8.2f} {rate:>14,.0f} {p50_2:>15.2f}")
    print(
        f"level-1 p99 with priorities / without: "
        f"{med('levels 2', 'p99_ms') / med('levels 1', 'p99_ms'):.2f}x; level-2 throughput "
        f"{med('levels 2', 'level2_req_s') / med('levels 1', 'level2_req_s'):.2f}x"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--saturating", type=int, default=64)
    parser.add_argument("--interval", type=float, default=0.005)
    args = parser.parse_args()
    loop = new_event_loop()
    try:
        loop.run_until_complete(main(args))
    finally:
        loop.close()
