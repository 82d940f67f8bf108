"""The decode step over the busy slots only: tokens/s at 25, 50 and 100% occupancy,
against every step running over all the slots (``step_slots=()``, what pxrt did before),
alternated in one process.

The demo decoder (``pxrt.demo``; ``--dim``, ``--layers``), ``--slots`` slots of a
``--max-length`` cache, greedy. Occupancy is set by a closed loop of that many callers
(8 of 32 slots: 25%); prompts 4-64 tokens and outputs 32-``--max-output`` tokens,
long-tailed. Reported: output tokens/s, ITL p50/p99, and the slots a step computed on
average.

    python benchmarks/occupancy.py [--repeats 3]
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


async def closed(dec, work, callers: int) -> dict:
    record: dict = {"itl": [], "tokens": 0}
    it = iter(work)

    async def caller():
        for prompt, m in it:
            times = []
            async for _ in dec.agenerate(prompt, max_tokens=m):
                times.append(time.perf_counter())
            record["itl"].extend(np.diff(times).tolist())
            record["tokens"] += len(times)

    c0 = dict(dec.counters)
    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    elapsed = time.perf_counter() - t0
    steps = max(dec.counters["steps"] - c0["steps"], 1)
    return {
        "tok/s": record["tokens"] / elapsed,
        "itl p50": float(np.percentile(record["itl"], 50) * 1e3),
        "itl p99": float(np.percentile(record["itl"], 99) * 1e3),
        "slots/step": (dec.counters["stepped_slots"] - c0["stepped_slots"]) / steps,
        "busy/step": (dec.counters["busy_slot_steps"] - c0["busy_slot_steps"]) / steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--max-output", type=int, default=160)
    p.add_argument("--dim", type=int, default=demo.LM_DIM)
    p.add_argument("--layers", type=int, default=demo.LM_LAYERS)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = demo.export_lm(
            os.path.join(tmp, "lm"),
            slots=args.slots,
            max_length=args.max_length,
            dim=args.dim,
            layers=args.layers,
        )
        # (one cache: the steps over fewer slots are its own)
        busy = pxrt.load(path, progress=False, length_tiers="off")
        every = pxrt.load(path, progress=False, step_slots=(), length_tiers="off")
        print(busy, "steps compiled for", busy.step_slots, "slots")
        for share in (0.25, 0.5, 1.0):
            callers = max(1, int(args.slots * share))
            runs: dict[str, list[dict]] = {"all slots": [], "busy only": []}
            for r in range(args.repeats):
                prompts = demo.lm_prompts(args.requests, seed=r, low=4, high=64)
                outputs = demo.token_lengths(args.requests, 32, args.max_output, seed=r + 1)
                work = [(pr, int(m)) for pr, m in zip(prompts, outputs)]
                for name, dec in (("all slots", every), ("busy only", busy)):
                    runs[name].append(asyncio.run(closed(dec, work, callers)))
            keys = list(runs["all slots"][0])
            med = {
                n: {k: statistics.median(x[k] for x in rs) for k in keys} for n, rs in runs.items()
            }
            print(
                f"\n{share:.0%} occupancy ({callers} callers, {args.slots} slots), medians of "
                f"{args.repeats} alternated runs"
            )
            print(f"{'':>12}" + "".join(f"{k:>12}" for k in keys))
            for name, m in med.items():
                print(f"{name:>12}" + "".join(f"{m[k]:>12.2f}" for k in keys))
            ratio = {k: med["busy only"][k] / med["all slots"][k] for k in keys}
            print(f"{'ratio':>12}" + "".join(f"{ratio[k]:>11.2f}x" for k in keys))
        assert busy.compiles_after_load == 0 and every.compiles_after_load == 0
        busy.close()
        every.close()


if __name__ == "__main__":
    main()
