"""One decoder shape, several sets of load options, alternated in one process.

Exports one of ``decoder_shapes``' models (``--shape``) once and loads it once per
variant (``--variant NAME=JSON``, the JSON a dict of ``pxrt.load`` options; a variant
with ``length_tiers="auto"`` serves the workload untimed until it has switched into its
tiers and served a run more without switching again, ``generation.settle``), then runs
closed loops of ``--slots`` callers over the lognormal workload, the variants
alternated, fresh prompt tokens each run. Prints each
variant's program prices as its load measured them (and again after a switch), each
run's tokens/s and latencies, with ``--detail`` the loop's counters and timings
(steps, prefills, wall time in each), then the medians and their ratios to the first
variant. ``--floor``: the first variant's step program against the model's own decode
(``jax.jit``, the cache donated) on a cache of the same shape, called back to back: what
the device's step costs without pxrt.

    python benchmarks/load_variants.py --shape js-wide --slots 64 \\
        --variant 'off={"length_tiers": "off"}' --variant 'auto={"length_tiers": "auto"}' \\
        [--requests 512] [--repeats 3] [--detail] [--floor]

A variant's ``"pin_placement": "beside"`` or ``"between"`` (not a load option) holds
its decoder's prefill placement at that rule, probing nothing. ``"copied_cache": true``
(keras-llama; not a load option either) loads an artifact of its own, exported with
the adapter's in-place cache updates off (``pxrt.adapters._inplace``): keras-hub's
step as it traces.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import decoder_shapes as ds  # noqa: E402
import generation  # noqa: E402

from pxrt.decoder.relayout import tiers_text  # noqa: E402


def variant(text: str) -> tuple[str, dict]:
    name, _, options = text.partition("=")
    try:
        got = json.loads(options)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME={{JSON options}} ({exc})") from None
    if not name or not isinstance(got, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: NAME={{JSON options}}")
    return name, got


def pin(dec, rule: str) -> None:
    """The decoder's prefill placement held at ``rule`` ("beside" or "between"): it
    serves every epoch so, probing nothing (``pxrt.decoder.placement``; what each rule
    makes alone, against which the measured choice is judged)."""
    from pxrt.decoder.placement import Placement

    if rule not in ("beside", "between") or dec._placement is None:
        raise SystemExit(f"pin_placement: {rule!r} needs \"beside\" or \"between\" and "
                         "a decoder that prefills beside its steps")  # fmt: skip
    held = Placement(between=rule == "between")
    held._ended = lambda rate: None  # type: ignore[method-assign]
    dec._placement = held


def ms(costs: dict) -> dict:
    return {k: round(v * 1e3, 3) for k, v in sorted(costs.items())}


def median_ms(fn, n: int = 50) -> float:
    """The least of three medians of ``n`` synchronous calls, in ms."""
    medians = []
    for _ in range(3):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return min(medians) * 1e3


def copied_cache(model: ds.Model, m: ds.Model, lengths) -> None:
    """``m`` exported as ``model`` is but with keras-hub's cache copies kept."""
    if model.shape.family != "keras-llama":
        raise SystemExit("copied_cache: a keras-hub model's (--shape keras-llama)")
    with ds.keras_adapter_without("in_place"):
        m.export(tempfile.mkdtemp(prefix="pxrt-variants-"), lengths)


def floor(model: ds.Model, slots: int, options: dict) -> None:
    """pxrt's whole plain step (one program, one step) against the model's decode."""
    only = options | {"step_slots": [], "step_lengths": [], "multi_step": 1}
    only.setdefault("length_tiers", "off")
    dec = ds.Model(model.shape, 0, only)
    dec.path = model.path
    d = dec.load(slots)

    def pxrt_step() -> None:
        d._state, tokens, _ = d._step(d._params, d._state)
        jax.block_until_ready(tokens)

    cache = model.empty_cache(slots)
    params = jax.device_put(model.params)
    token = jnp.zeros((slots,), jnp.int32)
    position = jnp.full((slots,), model.max_length // 4, jnp.int32)
    decode = jax.jit(model.decode, donate_argnums=(1,)).lower(params, cache, token, position)
    compiled = decode.compile()
    held = [cache]

    def plain() -> None:
        held[0], logits = compiled(params, held[0], token, position)
        jax.block_until_ready(logits)

    a, b = median_ms(pxrt_step), median_ms(plain)
    print(f"floor: pxrt's step {a:.3f} ms, the model's jitted decode {b:.3f} ms ({a / b:.2f}x)")
    d.close()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ds.add_shape_args(p)
    ds.add_workload_args(p)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--requests", type=int, help="default 8 per slot")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variant", action="append", type=variant, default=[], metavar="NAME=JSON")
    p.add_argument("--detail", action="store_true", help="counters and timings of each run")
    p.add_argument("--floor", action="store_true", help="the step against the model's decode")
    args = p.parse_args()
    variants = dict(args.variant) or {"default": {}}
    shape = ds.shape_from_args(args, args.shape)
    slots = args.slots
    work = ds.workload(args.requests or 8 * slots, shape, args.prompts, args.outputs, args.seed)
    model = ds.Model(shape, args.seed, {})
    lengths = ds.prefill_lengths(work, shape.max_length)
    model.export(tempfile.mkdtemp(prefix="pxrt-variants-"), lengths)
    print(f"{shape.describe()}\n  {ds.describe_work(work, args.prompts, args.outputs)}")
    if args.floor:
        floor(model, slots, next(iter(variants.values())))
    decoders = {}
    for name, options in variants.items():
        options = dict(options)
        pinned = options.pop("pin_placement", None)
        copied = options.pop("copied_cache", False)
        m = ds.Model(shape, args.seed, options)
        m.path = model.path
        if copied:
            copied_cache(model, m, lengths)
        d = decoders[name] = m.load(slots)
        if pinned is not None:
            pin(d, pinned)
        print(f"== {name} {options}: ready in {m.load_s:.1f}s, every program {m.all_s:.1f}s")
        print("   prices (ms):", ms(d.costs))
        warm = ds.fresh_tokens(work[: 4 * slots], shape, 99)
        asyncio.run(generation.closed("pxrt", d, warm, slots))
        generation.settle(d, work, shape, slots, f"   [{name}] ")
        if getattr(d, "relayout_status", "") == "switched":
            print("   prices after the switch (ms):", ms(d.costs), f"scale {d.relayout_scale:.2f}")
    gc.collect()
    rates: dict[str, list[float]] = {name: [] for name in decoders}
    for rep in range(args.repeats):
        order = list(decoders) if rep % 2 == 0 else list(decoders)[::-1]
        for name in order:
            d = decoders[name]
            before = dict(d.counters)
            d.drain_timings()
            r = asyncio.run(generation.closed("pxrt", d, ds.fresh_tokens(work, shape, rep), slots))
            s = generation.summary(r)
            rates[name].append(s["tok/s"])
            print(
                f"{rep} {name}: {s['tok/s']:.0f} tok/s, ttft p50/p99 {s['ttft p50']:.1f}/"
                f"{s['ttft p99']:.1f} ms, itl p50/p99 {s['itl p50']:.2f}/{s['itl p99']:.2f} ms "
                f"({r['elapsed']:.2f}s)",
                flush=True,
            )
            if args.detail:
                counts = {k: round(v - before.get(k, 0), 3) for k, v in d.counters.items()}
                print("   counters:", {k: v for k, v in counts.items() if v})
                timings = {
                    k: f"{len(v)} x {1e3 * statistics.median(v):.2f} ms = {sum(v):.2f}s"
                    for k, v in d.drain_timings().items() if v
                }  # fmt: skip
                print("   timings:", timings)
    first = statistics.median(next(iter(rates.values())))
    for name, d in decoders.items():
        rate = statistics.median(rates[name])
        tiers = tiers_text(d.tiers) if getattr(d, "tiers", ()) else "one cache"
        switches = d.counters.get("relayouts", 0)
        placement = d.scheduler_choices().get("prefill_placement")
        print(
            f"[{shape.name} x {slots}] {name}: {rate:.0f} tok/s ({rate / first:.2f}x), "
            f"{tiers}, {switches} switch(es)"
            + (f", prefill placement {placement}" if placement else "")
        )
        d.close()


if __name__ == "__main__":
    main()
