"""What the serving path costs per request, side by side in one process and one loop.

Closed-loop callers of 1-row requests (1 / 64 / 256 / 1024 of them), on a trivial model
(``y = x * 2 + 1``, 16 floats: the runtime is all there is) and on the demo MLP:

- pxrt: ``serving.Server`` with its defaults (eager dispatch, no batching delay);
- plain: a plain asyncio batcher (``serving.bench.baselines.PlainBatcher``: queue,
  concatenate, pad, one ``Compiled.__call__`` on a thread; eager, same buckets);
- null: futures resolved on the next loop iteration with no compute: the floor;
- ceiling: the device work alone: rows/s of the bucket that the callers' rows fill
  (min(callers, largest bucket) rows), executed back to back; and of the largest;
- with 1 caller also ``Model.run`` called inline, the latency floor of the runtime.

The alternatives take turns (the order rotates each repeat); the table shows medians of
the repeats and the ratios the closing notes quote.

    python benchmarks/serving_overhead.py [--duration 1] [--repeats 3] [--loop uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402
from serving import Server  # noqa: E402
from serving.bench.baselines import NullBatcher, PlainBatcher, run_ceiling  # noqa: E402
from serving.bench.loadgen import clock, closed_loop  # noqa: E402

BUCKETS = (1, 8, 64, 256)


def trivial(params, x):
    return {"y": x * params["a"] + params["b"]}


def export_models(root: str) -> dict[str, str]:
    paths = {
        "trivial": pxrt.export(
            trivial,
            {"a": np.float32(2), "b": np.float32(1)},
            os.path.join(root, "trivial"),
            inputs={"x": pxrt.TensorSpec((16,), "float32")},
            batch_buckets=BUCKETS,
            name="trivial",
        ),
        "demo": demo.export_demo(os.path.join(root, "demo"), buckets=BUCKETS),
    }
    return paths


async def measure_model(
    model: pxrt.Model, concurrency: list[int], duration: float, repeats: int
) -> dict:
    request = pxrt.example_inputs(model.inputs, 1, seed=0)
    results: dict[int, dict[str, list[dict]]] = {}
    ceilings: dict[int, list[float]] = {}
    async with Server() as server:
        server.add_model("m", model)
        plain = PlainBatcher(model)
        null = NullBatcher()
        alternatives = {
            "pxrt": functools.partial(server.infer, "m"),
            "plain": plain.infer,
            "null": null.infer,
        }

        async def model_run(r: dict) -> dict:
            return model.run(r)

        for c in concurrency:
            alts = dict(alternatives)
            if c == 1:
                alts["Model.run"] = model_run
            runs: dict[str, list[dict]] = {k: [] for k in alts}
            for _ in range(2):  # warm every path up
                for infer in alts.values():
                    await closed_loop(infer, request, c, 0.05)
            names = list(alts)
            for rep in range(repeats):
                turn = names[rep % len(names) :] + names[: rep % len(names)]
                for name in turn:
                    gc.collect()
                    cpu0 = time.process_time()
                    lat, elapsed, _ = await closed_loop(alts[name], request, c, duration)
                    cpu = time.process_time() - cpu0
                    runs[name].append(
                        {
                            "req_s": len(lat) / elapsed,
                            "p50_us": float(np.median(lat)) * 1e6,
                            "cpu_us": cpu / max(len(lat), 1) * 1e6,
                        }
                    )
                for size in {model.size_for(min(c, model.max_batch)), model.max_batch}:
                    ceilings.setdefault(size, []).append(
                        run_ceiling(model, duration / 2, size)["rows_per_s"]
                    )
            results[c] = runs
        plain.close()
    return {"runs": results, "ceilings": {k: statistics.median(v) for k, v in ceilings.items()}}


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(name: str, model: pxrt.Model, out: dict) -> None:
    ceilings = out["ceilings"]
    print(
        f"\n## {name}: buckets {model.buckets}, {len(model.devices)} device(s); ceiling "
        + ", ".join(f"bucket {b}: {v:,.0f} rows/s" for b, v in sorted(ceilings.items()))
    )
    print(
        f"{'callers':>7} {'pxrt req/s':>11} {'plain':>9} {'null':>10} "
        f"{'pxrt/plain':>10} {'pxrt/null':>9} {'pxrt/ceil':>9} {'/largest':>8} "
        f"{'p50 pxrt us':>11} {'plain':>7} {'null':>6}  {'CPU us/req: pxrt':>16} {'plain':>6} "
        f"{'null':>5}"
    )
    for c, runs in out["runs"].items():
        px, pl, nu = (med(runs[k], "req_s") for k in ("pxrt", "plain", "null"))
        ceiling = ceilings[model.size_for(min(c, model.max_batch))]
        largest = ceilings[model.max_batch]
        print(
            f"{c:>7} {px:>11,.0f} {pl:>9,.0f} {nu:>10,.0f} {px / pl:>9.2f}x {px / nu:>8.2f}x "
            f"{px / ceiling:>8.2f}x {px / largest:>7.2f}x "
            f"{med(runs['pxrt'], 'p50_us'):>11.1f} "
            f"{med(runs['plain'], 'p50_us'):>7.1f} {med(runs['null'], 'p50_us'):>6.1f}  "
            f"{med(runs['pxrt'], 'cpu_us'):>16.2f} {med(runs['plain'], 'cpu_us'):>6.2f} "
            f"{med(runs['null'], 'cpu_us'):>5.2f}"
        )
        if "Model.run" in runs:
            gap = med(runs["pxrt"], "p50_us") - med(runs["Model.run"], "p50_us")
            print(
                f"{'':>7} 1 caller: Server.infer p50 - Model.run p50 = {gap:.1f} us "
                f"(Model.run p50 {med(runs['Model.run'], 'p50_us'):.1f} us)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", default="1,64,256,1024")
    parser.add_argument("--models", default="trivial,demo")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]

    from serving.engine.server import new_event_loop

    print(
        f"jax {jax.__version__}, {jax.device_count()} device(s), Cython: "
        f"{pxrt.using_extensions()}, loop: {args.loop}, {args.duration:g} s x {args.repeats} "
        "repeats per alternative (medians)"
    )
    with tempfile.TemporaryDirectory(prefix="pxrt-overhead-") as tmp:
        paths = export_models(tmp)
        for name in args.models.split(","):
            model = pxrt.load(paths[name])
            gc.collect()
            gc.freeze()  # as pxrt bench and pxrt serve do after loading
            loop = new_event_loop() if args.loop == "uvloop" else asyncio.new_event_loop()
            try:
                t0 = clock()
                out = loop.run_until_complete(
                    measure_model(model, concurrency, args.duration, args.repeats)
                )
            finally:
                loop.close()
            report(name, model, out)
            print(f"({clock() - t0:.0f} s)")


if __name__ == "__main__":
    main()
