"""Long prompts and shared prefixes: chunked prefill and the prefix cache, each against
what a pxrt user had without them, alternated in one process.

The demo decoder (``pxrt.demo``, 2 layers, 64 wide; ``--dim``, ``--layers``), a
1,024-position cache, 16 slots, greedy decoding.

1. **Long prompts beside running streams.** ``--streams`` generations decode long
   outputs while prompts of ``--long`` tokens (4x the largest chunk) arrive every
   ``--every-ms``. Reported: the running streams' inter-token latency (p50, p99):
   - ``none``: no long prompts (the floor);
   - ``chunked``: pxrt's chunked prefill (one chunk of 128 tokens per loop turn,
     between decode steps);
   - ``whole``: the same decoder exported with a prefill length that holds the whole
     prompt (what a user had to do before: a prompt prefilled in one program, every
     stream stalled meanwhile).
2. **A chat workload.** Every request is a shared system prompt of ``--system``
   tokens, then its own 16-64 tokens; outputs 16-64 tokens; a closed loop of
   ``--concurrency`` callers. The prefix cache on against off (``prefix_cache=False``
   per request: the same programs): output tokens/s, time to first token, ITL.

    python benchmarks/long_prompts.py [--repeats 3]
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

MAX_LENGTH = 1024
LENGTHS = (16, 32, 64, 128)
CHUNKS = (16, 32, 64, 128)


def q(xs: list[float], p: float) -> float:
    return float(np.percentile(xs, p) * 1e3) if xs else float("nan")


async def stream(dec, prompt, max_tokens, record, **options) -> None:
    t0 = time.perf_counter()
    times = []
    async for _ in dec.agenerate(prompt, max_tokens=max_tokens, **options):
        times.append(time.perf_counter())
    record["ttft"].append(times[0] - t0)
    record["itl"].extend(np.diff(times).tolist())
    record["tokens"] += len(times)


# --------------------------------------------------------------------------- 1. long prompts


async def beside(dec, args, long_prompts: bool, seed: int) -> dict:
    """Running streams' ITL while long prompts arrive (or not)."""
    rng = np.random.default_rng(seed)
    running: dict = {"ttft": [], "itl": [], "tokens": 0}
    arrivals: dict = {"ttft": [], "itl": [], "tokens": 0}
    short = [rng.integers(32, 127, 8).astype(np.int32) for _ in range(args.streams)]
    tasks = [asyncio.create_task(stream(dec, p, args.stream_tokens, running)) for p in short]
    await asyncio.sleep(0.2)  # every stream decoding
    if long_prompts:
        for _ in range(args.arrivals):
            prompt = rng.integers(32, 127, args.long).astype(np.int32)
            tasks.append(asyncio.create_task(stream(dec, prompt, 4, arrivals, prefix_cache=False)))
            await asyncio.sleep(args.every_ms / 1e3)
    await asyncio.gather(*tasks)
    return {
        "itl p50": q(running["itl"], 50),
        "itl p99": q(running["itl"], 99),
        "long ttft p50": q(arrivals["ttft"], 50),
    }


# --------------------------------------------------------------------------- 2. chat


async def chat(dec, args, cache: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    system = np.random.default_rng(0).integers(32, 127, args.system).astype(np.int32)
    work = [
        (
            np.concatenate([system, rng.integers(32, 127, int(rng.integers(16, 65)))]).astype(
                np.int32
            ),
            int(rng.integers(16, 65)),
        )
        for _ in range(args.requests)
    ]
    record: dict = {"ttft": [], "itl": [], "tokens": 0}
    it = iter(work)

    async def caller():
        for prompt, m in it:
            await stream(dec, prompt, m, record, prefix_cache=cache)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - t0
    return {
        "tok/s": record["tokens"] / elapsed,
        "ttft p50": q(record["ttft"], 50),
        "ttft p99": q(record["ttft"], 99),
        "itl p50": q(record["itl"], 50),
        "itl p99": q(record["itl"], 99),
    }


def table(title: str, runs: dict[str, list[dict]], base: str) -> None:
    print(f"\n{title} (medians of {len(next(iter(runs.values())))} alternated runs)")
    keys = list(next(iter(runs.values()))[0])
    print(f"{'':>12}" + "".join(f"{k:>15}" for k in keys))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()
    }
    for name, m in med.items():
        print(f"{name:>12}" + "".join(f"{m[k]:>15.2f}" for k in keys))
    for name, m in med.items():
        if name != base:
            print(
                f"{name + '/' + base:>12}" + "".join(f"{m[k] / med[base][k]:>14.2f}x" for k in keys)
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=300)
    p.add_argument("--long", type=int, default=4 * CHUNKS[-1])
    p.add_argument("--arrivals", type=int, default=8)
    p.add_argument("--every-ms", type=float, default=40.0)
    p.add_argument("--system", type=int, default=256)
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--only", choices=("long", "chat"), default=None)
    p.add_argument("--dim", type=int, default=demo.LM_DIM)
    p.add_argument("--chunk-tokens", type=int, default=None)
    p.add_argument("--layers", type=int, default=demo.LM_LAYERS)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        chunked = pxrt.load(
            demo.export_lm(
                os.path.join(tmp, "chunked"),
                slots=args.slots,
                max_length=MAX_LENGTH,
                prefill_lengths=LENGTHS,
                chunk_lengths=CHUNKS,
                dim=args.dim,
                layers=args.layers,
            ),
            progress=False,
            chunk_tokens=args.chunk_tokens,
            length_tiers="off",  # (one cache on both sides: chunking is what differs)
        )
        print(chunked, chunked.load_summary(), "chunk tokens per turn", chunked.chunk_tokens)
        if args.only != "chat":
            whole = pxrt.load(
                demo.export_lm(
                    os.path.join(tmp, "whole"),
                    slots=args.slots,
                    max_length=MAX_LENGTH,
                    prefill_lengths=(*LENGTHS, args.long),
                    extend=False,
                    dim=args.dim,
                    layers=args.layers,
                ),
                progress=False,
                length_tiers="off",
            )
            runs: dict[str, list[dict]] = {"none": [], "chunked": [], "whole": []}
            for r in range(args.repeats):
                for name, dec, arrive in (
                    ("none", chunked, False),
                    ("chunked", chunked, True),
                    ("whole", whole, True),
                ):
                    runs[name].append(asyncio.run(beside(dec, args, arrive, seed=r)))
            table(
                f"1. running streams' ITL while {args.arrivals} prompts of {args.long} tokens "
                f"arrive every {args.every_ms:g} ms ({args.streams} streams, {args.slots} slots)",
                runs,
                "none",
            )
            whole.close()
        if args.only != "long":
            runs = {"off": [], "on": []}
            for r in range(args.repeats):
                for name, cache in (("off", False), ("on", True)):
                    runs[name].append(asyncio.run(chat(chunked, args, cache, seed=100 + r)))
            table(
                f"2. chat: a {args.system}-token system prompt shared by {args.requests} "
                f"requests, {args.concurrency} callers; the prefix cache",
                runs,
                "off",
            )
            print("prefix cache:", chunked.prefix.index.counters if chunked.prefix else None)
        assert chunked.compiles_after_load == 0
        chunked.close()


if __name__ == "__main__":
    main()
