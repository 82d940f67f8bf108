"""The decoder loop's choices against the rules before them, same decoder, alternated.

``--ab pricing``: the priced admission against the rule before it (one prefill a turn
of the loop, at the smallest cell that holds the queue's head run). Priced: each turn's
prefills at the cells with the most prompts per measured second, within the turn's
bound (``itl_bound_ms``). ``--ab windows``: steps over a window of the cache while every
busy slot is inside it (``step_lengths``) against steps over the whole cache always.
``--ab overlap``: prefills on a thread of their own beside the steps
(``overlap_prefill``, the default on CPU) against each prefill between two steps on
the loop's thread (two decoders of the same artifact). ``--ab ahead``: with every slot
taken, the next prompts prefilled ahead of a free slot against prefills only into free
slots (give it more ``--callers`` than slots); ``--ab ahead-units``: units prefilled ahead
of free slots of several prompts (each row inserted as a slot frees) against one prompt a
unit. ``--ab greedy``: a decoder whose programs
pick greedily with no sampling branch (no ``lax.cond``: what programs chosen by the host
for greedy rows would give at most) against today's, two loads of the same artifact (the
workload is greedy); ``--ab greedy-steps``: the same for the plain steps only (the
prefills' inserts and the step with the controls as they are: what greedy twins of
the plain steps would give). ``--ab tiers``: a decoder loaded with the length tiers the
one-cache decoder suggests after serving the workload once (untimed), against it, every
other option the default (the prefix cache and chunking on in both). ``--ab auto``:
a decoder loaded with ``length_tiers="auto"`` serves the workload until it has changed
into the tiers its traffic suggests (its first run against the one-cache decoder's
first: what the switch costs while it compiles), then against the one-cache decoder.
``--ab option --option KEY=VALUE``: a decoder loaded with those load options (VALUE as
JSON) against one without (``--base KEY=VALUE``: options of both; an A/A with none
shows the harness's own spread). Otherwise one decoder serves both sides (switched
between runs), the demo decoder's math at the shape given, a closed loop of
``--callers`` (default ``--slots``) over lognormal prompt and output lengths, fresh
prompt tokens each run (none in the prefix cache). Prints each run, then medians and
ratios.

    python benchmarks/scheduler.py [--ab pricing|windows|overlap|ahead|ahead-units|greedy|
        greedy-steps|tiers|auto]
        [--ab option --option multi_step=1 [--base length_tiers='"off"']]
        [--dim 128 --heads 4 --layers 2 --slots 16] [--callers N] [--max-length 512]
        [--requests 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from generation import closed, summary  # noqa: E402

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402
from pxrt.decoder.relayout import tiers_text  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--callers", type=int, help="closed loop (default: --slots)")
    p.add_argument(
        "--ab",
        choices=(
            "pricing", "windows", "overlap", "ahead", "ahead-units", "greedy", "greedy-steps",
            "tiers", "auto", "option",
        ),  # fmt: skip
        default="pricing",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--ab option: a load option of the other decoder (VALUE as JSON)",
    )
    p.add_argument(
        "--base",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--ab option: a load option of both decoders (VALUE as JSON)",
    )
    args = p.parse_args()
    callers = args.callers or args.slots
    lengths = tuple(n for n in (16, 32, 64, 128, 256) if n < args.max_length)
    path = demo.export_lm(
        os.path.join(tempfile.mkdtemp(), "lm"), slots=args.slots, max_length=args.max_length,
        prefill_lengths=lengths, dim=args.dim, heads=args.heads, layers=args.layers,
    )  # fmt: skip
    base = options(args.base)
    # (one cache: what each A/B is against)
    dec = pxrt.load(path, **{"length_tiers": "off", **base})
    dec.wait_programs()  # (none compiling beside the runs)
    other = None  # (the second decoder: overlap's "before", greedy's "greedy")
    if args.ab == "overlap":
        other = pxrt.load(path, overlap_prefill=False, length_tiers="off")
        other.wait_programs()
    elif args.ab in ("greedy", "greedy-steps"):
        other = greedy_only(path, steps_only=args.ab == "greedy-steps")
    elif args.ab == "option":
        other = pxrt.load(path, **{"length_tiers": "off", **base, **options(args.option)})
        other.wait_programs()
    print("measured ms:", {k: round(v * 1e3, 3) for k, v in dec.costs.items()})
    print(f"turn bound: {dec.itl_bound_s * 1e3:.2f} ms")
    rng = np.random.default_rng(0)

    def lognormal(median: float, low: int, high: int) -> np.ndarray:
        drawn = rng.lognormal(np.log(median), 0.8, args.requests)
        return np.clip(np.round(drawn), low, high).astype(int)

    prompts, outputs = lognormal(48, 8, max(lengths)), lognormal(24, 8, 128)
    work = [
        (rng.integers(0, demo.LM_VOCAB - 2, size=n).astype(np.int32), int(m))
        for n, m in zip(prompts, outputs)
    ]
    if args.ab == "tiers":  # (sized by this workload, served once untimed)
        asyncio.run(closed("pxrt", dec, work, callers))
        tiers = dec.suggested_length_tiers()
        if tiers is None:
            raise SystemExit("no length tiers suggested: more --requests")
        print("length tiers:", tiers)
        other = pxrt.load(path, length_tiers=tiers)
        other.wait_programs()
    if args.ab == "auto":
        other = switched(path, dec, work, callers)
    priced, windows = dec._priced, dec.step_lengths
    new = {
        "pricing": "priced", "windows": "windows", "overlap": "beside", "ahead": "ahead",
        "ahead-units": "units", "greedy": "greedy", "greedy-steps": "greedy", "tiers": "tiers",
        "auto": "auto", "option": "option",
    }[args.ab]  # fmt: skip
    runs: dict[str, list[dict]] = {new: [], "before": []}
    for rep in range(args.repeats):
        fresh = [(rng.integers(0, demo.LM_VOCAB - 2, size=len(p)).astype(np.int32), m)
                 for p, m in work]  # fmt: skip
        for mode in runs if rep % 2 == 0 else list(runs)[::-1]:
            target = dec
            if args.ab == "pricing":  # (the rule before: unpriced)
                dec._priced = priced if mode == new else 0
            elif args.ab == "windows":  # (before: every step over the whole cache)
                dec.step_lengths = windows if mode == new else ()
            elif args.ab == "ahead":  # (before: prefills only into free slots)
                dec.__dict__.pop("_prefills_ahead", None)
                if mode == "before":
                    dec._prefills_ahead = lambda: False  # type: ignore[method-assign]
            elif args.ab == "ahead-units":  # (before: one prompt a unit ahead of slots)
                dec._ahead_rows = 0 if mode == new else 1
            elif args.ab == "overlap" and mode == "before":  # (each between two steps)
                target = other
            elif args.ab in ("greedy", "greedy-steps", "tiers", "auto", "option") and mode == new:
                target = other
            runs[mode].append(summary(asyncio.run(closed("pxrt", target, fresh, callers))))
            print(rep, mode, {k: round(v, 2) for k, v in runs[mode][-1].items()}, flush=True)
    dec.close()
    if other is not None:
        if args.ab == "auto":  # (a switch during the runs would have compiled beside them)
            tiers = tiers_text(other.tiers)
            print(f"auto after the runs: {tiers}, {other.counters['relayouts']} switch(es)")
        other.close()
    print(f"\n{'':<10} {new:>10} {'before':>10} {'ratio':>7}")
    for key in ("tok/s", "itl p50", "itl p99", "ttft p50", "ttft p99"):
        a = float(np.median([r[key] for r in runs[new]]))
        b = float(np.median([r[key] for r in runs["before"]]))
        print(f"{key:<10} {a:>10.2f} {b:>10.2f} {a / b:>6.2f}x")


def options(pairs: list[str]) -> dict:
    """``KEY=VALUE`` pairs as load options (VALUE as JSON)."""
    return {k: json.loads(v) for k, _, v in (o.partition("=") for o in pairs)}


def switched(path: str, dec: pxrt.Decoder, work: list, callers: int) -> pxrt.Decoder:
    """``path`` loaded with ``length_tiers="auto"``, served ``work`` until it has
    switched into tiers: its first run (the switch's compile beside it) printed against
    ``dec``'s first run of the same work."""
    auto = pxrt.load(path, length_tiers="auto")
    auto.wait_programs()
    first = [summary(asyncio.run(closed("pxrt", d, work, callers))) for d in (auto, dec)]
    ratio = first[0]["tok/s"] / first[1]["tok/s"]
    print(f"first run, auto / one cache: {ratio:.2f}x tok/s ({auto.relayout_status})")
    t0, run = time.perf_counter(), 2
    while auto.relayout_status not in ("switched", "failed") and time.perf_counter() - t0 < 600:
        if not auto.relayout_status and run > 20:
            break  # (nothing suggested)
        got = summary(asyncio.run(closed("pxrt", auto, work, callers)))
        print(f"auto, run {run}: {got['tok/s']:.0f} tok/s ({auto.relayout_status})")
        run += 1
    if auto.relayout_status != "switched":
        raise SystemExit(f"no switch into tiers: {auto.relayout_status or 'none suggested'}")
    print("length tiers:", tiers_text(auto.tiers))
    return auto


def greedy_only(path: str, steps_only: bool = False) -> pxrt.Decoder:
    """``path`` loaded with every program's choice a greedy pick alone: no controls, no
    scores, no sampling ``lax.cond`` (a ``cond`` costs 20-30 us a program on XLA:CPU
    whatever its branches: ``benchmarks/cond_cost.py``); ``steps_only``: the plain
    steps' only (their choice is the one made without the controls). Its own compiles
    (pxrt's stored programs are keyed by the code's files, which the patch does not
    change)."""
    import jax.numpy as jnp

    from pxrt import sampling
    from pxrt.decoder import programs

    def choose(self, logits, ints, floats, position, state, index, cols, full=True):
        if steps_only and full:
            return real(self, logits, ints, floats, position, state, index, cols, full)
        n, width = logits.shape[0], 1 + 2 * sampling.top_count(logits.shape[-1])
        tokens = sampling.greedy(logits.astype(jnp.float32))
        return tokens, jnp.zeros((n, width), jnp.float32), jnp.zeros(n, bool)

    real = programs.DecoderPrograms._choose
    programs.DecoderPrograms._choose = choose  # type: ignore[method-assign]
    try:
        dec = pxrt.load(path, compilation_cache=False, length_tiers="off")
        dec.wait_programs()  # (the later programs are traced with the patch too)
    finally:
        programs.DecoderPrograms._choose = real  # type: ignore[method-assign]
    return dec


if __name__ == "__main__":
    main()
