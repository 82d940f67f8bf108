"""Speculative decoding by prompt lookup: output tokens/s and inter-token latency with
``speculative_tokens`` drafts against plain steps, alternated in one process.

The demo decoder (``pxrt.demo``; ``--dim``, ``--layers``), ``--slots`` slots, greedy, a
closed loop of ``--callers``. Two workloads, so that the ratio is not one tuned on:

- ``repetitive``: each prompt is a random segment of 4-16 tokens said 3-8 times (code,
  tables, quoting: text whose continuation was seen before);
- ``random``: random prompts of 8-64 tokens: drafts come only from what the model
  itself repeats.

Outputs are 32-``--max-output`` tokens. Reported per workload: tokens/s, ITL p50/p99
(between two tokens a reader gets: a verify gives several at once), drafted and accepted
tokens per verify.

    python benchmarks/speculative.py [--repeats 3] [--speculative-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import occupancy  # noqa: E402

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402


def workload(kind: str, n: int, max_output: int, seed: int) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    work = []
    for _ in range(n):
        if kind == "repetitive":
            segment = rng.integers(32, 127, int(rng.integers(4, 17)), dtype=np.int32)
            prompt = np.tile(segment, int(rng.integers(3, 9)))
        else:
            prompt = rng.integers(32, 127, int(rng.integers(8, 65)), dtype=np.int32)
        work.append((prompt, int(rng.integers(32, max_output + 1))))
    return work


async def closed(dec, work, callers: int) -> dict:
    """``occupancy.closed``'s tokens/s and ITL, with the drafts and accepted tokens per
    verify."""
    c0 = dict(dec.counters)
    got = await occupancy.closed(dec, work, callers)
    verifies = max(dec.counters["verifies"] - c0["verifies"], 1)
    return {
        **{k: got[k] for k in ("tok/s", "itl p50", "itl p99")},
        "drafted/verify": (dec.counters["drafted_tokens"] - c0["drafted_tokens"]) / verifies,
        "accepted/verify": (dec.counters["accepted_tokens"] - c0["accepted_tokens"]) / verifies,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--callers", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--speculative-tokens", type=int, default=4)
    p.add_argument("--dim", type=int, default=demo.LM_DIM)
    p.add_argument("--layers", type=int, default=demo.LM_LAYERS)
    args = p.parse_args()
    path = demo.export_lm(
        os.path.join(tempfile.mkdtemp(), "lm"),
        slots=args.slots,
        max_length=512,
        dim=args.dim,
        layers=args.layers,
    )
    common = {"prefix_cache_tokens": 0, "step_slots": (), "length_tiers": "off"}
    decoders = {
        "plain": pxrt.load(path, **common),
        "speculative": pxrt.load(path, speculative_tokens=args.speculative_tokens, **common),
    }
    for kind in ("repetitive", "random"):
        results: dict = {name: [] for name in decoders}
        for r in range(args.repeats):
            work = workload(kind, args.requests, args.max_output, seed=r)
            for name, dec in decoders.items():
                asyncio.run(closed(dec, work[:8], args.callers))  # warm
                results[name].append(asyncio.run(closed(dec, work, args.callers)))
        print(
            f"\n{kind}: {args.requests} requests, {args.callers} callers, medians of {args.repeats}"
        )
        keys = list(results["plain"][0])
        print(f"{'':12}" + "".join(f"{k:>16}" for k in keys))
        med = {
            name: {k: statistics.median(x[k] for x in runs) for k in keys}
            for name, runs in results.items()
        }
        for name in decoders:
            print(f"{name:12}" + "".join(f"{med[name][k]:16.2f}" for k in keys))
        ratio = med["speculative"]["tok/s"] / med["plain"]["tok/s"]
        p99 = med["speculative"]["itl p99"] / med["plain"]["itl p99"]
        print(f"speculative / plain: tokens/s {ratio:.2f}x, ITL p99 {p99:.2f}x")
    for dec in decoders.values():
        dec.close()


if __name__ == "__main__":
    main()
