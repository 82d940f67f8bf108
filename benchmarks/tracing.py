"""What request tracing costs on the request core, in one process.

Closed-loop callers send one-row requests to the demo MLP through ``core.infer`` (the
path every front end takes: decode, queue, batch, encode) with tracing off (no
``Tracing``: what ``pxrt serve`` runs without ``--trace-rate``), one request in 100
traced, and every request traced, taking turns. The spans go through the SDK's batching
processor to an exporter that drops them (what leaves the process is the collector's
cost, not pxrt's).

    python benchmarks/tracing.py [--duration 2] [--repeats 3] [--callers 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402
from serving import Server, Tracing  # noqa: E402
from serving.bench.loadgen import closed_loop  # noqa: E402
from serving.kserve import core  # noqa: E402
from serving.kserve.core import InferRequest  # noqa: E402
from serving.loops import new_event_loop  # noqa: E402


class Dropped(SpanExporter):
    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans):  # type: ignore[no-untyped-def]
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


async def run_once(model: pxrt.Model, rate: int | None, args) -> dict:
    tracing, exporter = None, Dropped()
    if rate is not None:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        tracing = Tracing(rate, provider)
    x = np.asarray(pxrt.example_inputs(model.inputs, 1, seed=0)["x"])
    request = InferRequest({"x": x}, [("y", False)])

    def encode(name, model, request, outputs):  # type: ignore[no-untyped-def]
        return outputs["y"]

    async with Server(tracing=tracing) if tracing is not None else Server() as server:
        server.add_model("m", model)

        def infer(_):  # type: ignore[no-untyped-def]
            return core.infer(server, "m", None, lambda m: request, encode)

        lat, elapsed, _ = await closed_loop(infer, None, args.callers, args.duration)
    if rate is not None:
        provider.shutdown()
    return {"req_s": len(lat) / elapsed, "p50_ms": float(np.median(lat)) * 1e3}


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = pxrt.load(demo.export_demo(os.path.join(tmp, "mlp"), buckets=(1, 8, 32)))
        configs = {"off": None, "1 in 10000": 10000, "1 in 100": 100, "every request": 1}
        runs: dict[str, list[dict]] = {k: [] for k in configs}
        await run_once(model, 1, args)  # warm up
        for rep in range(args.repeats):
            order = list(configs) if rep % 2 == 0 else list(reversed(configs))
            for name in order:
                runs[name].append(await run_once(model, configs[name], args))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    print(
        f"\n{args.callers} closed-loop callers through the request core, demo MLP, one-row "
        f"requests; medians of {args.repeats} alternated runs of {args.duration:g} s"
    )
    print(f"{'tracing':<15} {'req/s':>9} {'p50 ms':>7} {'req/s vs off':>13} {'rounds':>14}")
    for name in configs:
        # Each round's ratio against that round's run without tracing (the noise's range).
        rounds = [r["req_s"] / off["req_s"] for r, off in zip(runs[name], runs["off"])]
        print(
            f"{name:<15} {med(name, 'req_s'):>9,.0f} {med(name, 'p50_ms'):>7.2f} "
            f"{med(name, 'req_s') / med('off', 'req_s'):>12.3f}x "
            f"{min(rounds):>6.3f}-{max(rounds):.3f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--callers", type=int, default=64)
    args = parser.parse_args()
    loop = new_event_loop()
    try:
        loop.run_until_complete(main(args))
    finally:
        loop.close()
