"""Generation: pxrt's continuous batching vs static batching, side by side in one process.

One decoder (``benchmarks/decoder_shapes.py``: ``--shape``, by default ``pxrt.demo``'s
byte-level transformer, 2 layers, 64 wide, a 256-position cache; any size, cache layout
or keras-hub's Llama by flags), prompts and output lengths both long-tailed (``--prompts``,
``--outputs``: lognormal by default, Pareto as an option), greedy decoding:

- pxrt: the model exported once and loaded at ``--slots`` slots, every other load option
  at its default; ``Decoder.agenerate`` (continuous batching; tokens streamed as they
  come);
- static: what a JAX user writes without pxrt: a worker takes up to ``--slots`` waiting
  prompts, pads them to the longest (rounded up to a prefill length, so it compiles once
  per length), prefills them and runs a jitted decode loop (``lax.while_loop``, compiled
  before the run) for as many steps as the longest of them asks, then hands every prompt
  all its tokens at once. Its first token arrives with its last. The same prefill and
  decode functions as pxrt's.

Both serve the same requests (each run's prompts drawn afresh, the same lengths: a
repeated prompt would be in pxrt's prefix cache): a closed loop of ``--callers``
callers, then Poisson arrivals at fractions of pxrt's closed-loop request rate. Reported
per run: output tokens/s over the whole run and in the closed loop's steady window
(while every caller still has a request: without the ramp-up and the drain), time to
first token (p50/p99), inter-token latency (pxrt; p50/p99). The runs alternate,
``--repeats`` times; the table shows medians and the ratios.

For keras-hub's Llama (``--shape keras-llama``), keras-hub's own ``generate()`` too, on
length-sorted batches of ``--slots`` of the same prompts (``decoder_shapes.keras_generate``),
its tokens checked against pxrt's greedy ones.

Then the per-step host overhead at ``--slots`` busy slots: the loop's step time (every
slot generating, steady state) minus the decode step's device time (the compiled step
called back to back with nothing else on the host). And the floor it gives: ``--slots``
tokens per step program alone, what the device's steps would make with no prefill, no
insert and no host work, against which both runtimes' tokens/s are shown.

    python benchmarks/generation.py [--shape demo|js-small|js-wide|keras-llama] \\
        [--layers N] [--d-model N] [--heads N] [--mlp N] [--max-length N] [--vocab N] \\
        [--layout array|layers] [--positions learned|sinusoid] \\
        [--prompts lognormal:48:8:256] [--outputs lognormal:24:8:128] \\
        [--requests 1024] [--slots 32] [--callers 64] [--repeats 3] [--quick]

The workload before these flags: ``--prompts pareto:4:64 --outputs pareto:8:192``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import queue
import statistics
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import decoder_shapes as ds  # noqa: E402

from pxrt import demo  # noqa: E402
from pxrt.decoder.relayout import tiers_text  # noqa: E402


def workload(n: int, seed: int, max_prompt: int, max_output: int) -> list[tuple[np.ndarray, int]]:
    """The Pareto workload of the demo decoder (``benchmarks/generation_wire.py``'s)."""
    prompts = demo.lm_prompts(n, seed=seed, low=4, high=max_prompt)
    outputs = demo.token_lengths(n, low=8, high=max_output, seed=seed + 1)
    return [(p, int(m)) for p, m in zip(prompts, outputs)]


# --------------------------------------------------------------------------- static batching


class StaticBatcher:
    """A batch of up to ``batch`` prompts at a time, decoded until its longest is done."""

    def __init__(self, model: ds.Model, batch: int, lengths: tuple[int, ...]) -> None:
        self.batch = batch
        self.lengths = lengths
        self.max_length = max_length = model.max_length
        self.eos = model.eos
        self.params = jax.device_put(model.params)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

        def run(params, tokens, lengths, steps):
            rows, logits = model.prefill(params, tokens, lengths)
            cache = model.put_rows(model.empty_cache(batch), rows, 0)
            first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            out = jnp.zeros((batch, max_length), jnp.int32).at[:, 0].set(first)

            def body(carry):
                i, cache, token, position, out = carry
                cache, logits = model.decode(params, cache, token, position)
                token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                return i + 1, cache, token, position + 1, out.at[:, i].set(token)

            init = (jnp.int32(1), cache, first, lengths, out)
            return lax.while_loop(lambda c: c[0] < steps, body, init)[4]

        spec = jax.ShapeDtypeStruct
        self.compiled = {
            n: jax.jit(run)
            .lower(
                self.params,
                spec((batch, n), jnp.int32),
                spec((batch,), jnp.int32),
                spec((), jnp.int32),
            )
            .compile()
            for n in lengths
        }
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    async def generate(self, prompt: np.ndarray, max_tokens: int) -> list[int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.queue.put((prompt, max_tokens, loop, future))
        return await future

    def _work(self) -> None:
        while True:
            items = [self.queue.get()]
            while len(items) < self.batch:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            longest = max(len(p) for p, *_ in items)
            n = next(x for x in self.lengths if x >= longest)
            tokens = np.zeros((self.batch, n), np.int32)
            lengths = np.ones(self.batch, np.int32)
            for i, (p, *_) in enumerate(items):
                tokens[i, : len(p)] = p
                lengths[i] = len(p)
            want = [min(m, self.max_length - len(p)) for p, m, *_ in items]
            out = np.asarray(self.compiled[n](self.params, tokens, lengths, np.int32(max(want))))
            for i, (_, _, loop, future) in enumerate(items):
                row = out[i, : want[i]].tolist()
                if self.eos in row:
                    row = row[: row.index(self.eos) + 1]
                loop.call_soon_threadsafe(_resolve, future, row)


def _resolve(future, value) -> None:
    if not future.done():
        future.set_result(value)


# --------------------------------------------------------------------------- clients


async def one(kind, target, prompt, max_tokens, record) -> None:
    t0 = time.perf_counter()
    if kind == "pxrt":
        times = []
        async for _ in target.agenerate(prompt, max_tokens=max_tokens):
            times.append(time.perf_counter())
        record["ttft"].append(times[0] - t0)
        record["itl"].extend(np.diff(times).tolist())
        record["tokens"] += len(times)
        record["stamps"].extend(times)
    else:
        tokens = await target.generate(prompt, max_tokens)
        now = time.perf_counter()
        record["ttft"].append(now - t0)
        record["tokens"] += len(tokens)
        record["stamps"].extend([now] * len(tokens))


async def closed(kind, target, work, concurrency, one=one) -> dict:
    """``concurrency`` callers take the requests of ``work`` in turn until none is left.
    Besides the whole run's numbers, records the steady window: from a tenth of the way
    to the moment the last request was taken, while every caller still has one (the
    ramp-up before and the drain after, when the last long generations finish with few
    slots busy, are left out)."""
    record: dict = {"ttft": [], "itl": [], "tokens": 0, "stamps": [], "exhausted": 0.0}
    it = iter(work)

    async def caller():
        for prompt, m in it:
            await one(kind, target, prompt, m, record)
        record["exhausted"] = record["exhausted"] or time.perf_counter()

    record["t0"] = t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    record["elapsed"] = time.perf_counter() - t0
    return record


async def poisson(kind, target, work, rate, seed) -> dict:
    record: dict = {"ttft": [], "itl": [], "tokens": 0, "stamps": []}
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(work))
    t0 = time.perf_counter()
    tasks = []
    at = t0
    for (prompt, m), gap in zip(work, gaps):
        at += gap
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(kind, target, prompt, m, record)))
    await asyncio.gather(*tasks)
    record["elapsed"] = time.perf_counter() - t0
    return record


def summary(r: dict) -> dict:
    q = lambda xs, p: float(np.percentile(xs, p) * 1e3) if xs else float("nan")  # noqa: E731
    steady = float("nan")
    if r.get("exhausted"):
        start = r["t0"] + 0.1 * (r["exhausted"] - r["t0"])
        stamps = np.asarray(r["stamps"])
        inside = int(((stamps >= start) & (stamps <= r["exhausted"])).sum())
        steady = inside / (r["exhausted"] - start)
    return {
        "tok/s": r["tokens"] / r["elapsed"],
        "steady tok/s": steady,
        "ttft p50": q(r["ttft"], 50),
        "ttft p99": q(r["ttft"], 99),
        "itl p50": q(r["itl"], 50),
        "itl p99": q(r["itl"], 99),
    }


def settle(dec, work, shape, callers: int, label: str = "") -> None:
    """A decoder that sizes its length tiers from the traffic (``dec.auto_tiers``: the
    default on CPU devices at 16 slots or more) serves ``work`` (on prompts of its own)
    until it has switched into them and served one run more without switching again
    (the first samples can undercount the long prompts, and a second switch would
    compile beside a timed run), so that the timed runs measure the decoder it settles
    into: at most 10 minutes, or 20 runs while it suggests none."""
    if not getattr(dec, "auto_tiers", False):
        return
    t0 = time.perf_counter()
    rep = 0
    switches = -1  # (the switches before the last run, once switched)
    while time.perf_counter() - t0 < 600:
        if dec.relayout_status == "failed" or (not dec.relayout_status and rep >= 20):
            break
        if dec.relayout_status == "switched":
            if dec.counters["relayouts"] == switches:
                break
            switches = dec.counters["relayouts"]
        asyncio.run(closed("pxrt", dec, ds.fresh_tokens(work, shape, 200 + rep), callers))
        rep += 1
    tiers = tiers_text(dec.tiers) or "one cache"
    print(
        f"{label}length tiers from the traffic: {tiers} ({dec.relayout_status or 'none'} "
        f"after {time.perf_counter() - t0:.1f}s)",
        flush=True,
    )


# --------------------------------------------------------------------------- host overhead


def step_overhead(dec, steps: int = 300, repeats: int = 3) -> dict:
    """With every slot generating: the loop's step time, and its thread's CPU time per
    step (the host work: dispatch, read, route, wake); against the step program alone,
    called back to back on the same state. Alternated ``repeats`` times; medians. (With
    length tiers each generation fits the shortest tier, so that every slot is busy.)"""
    loop_wall, loop_cpu, alone = [], [], []
    most = min((length for _, length in dec.tiers), default=dec.max_length)
    for _ in range(repeats):
        gens = [dec.submit([65 + i % 26], max_tokens=most - 1) for i in range(dec.slots)]
        while dec.busy_slots < dec.slots:
            time.sleep(0.001)
        time.sleep(0.02)
        c0 = dict(dec.counters)
        while dec.counters["steps"] - c0["steps"] < steps and dec.busy_slots == dec.slots:
            time.sleep(0.005)
        n = max(dec.counters["steps"] - c0["steps"], 1)
        loop_wall.append((dec.counters["step_wall_s"] - c0["step_wall_s"]) / n)
        loop_cpu.append((dec.counters["step_host_cpu_s"] - c0["step_host_cpu_s"]) / n)
        for g in gens:
            g.cancel()
        while dec.busy_slots:
            time.sleep(0.001)
        time.sleep(0.02)
        # The step program alone, back to back, on the decoder's own state (idle loop).
        state = dec._state
        for _ in range(10):
            state, tokens, _ = dec._step(dec._params, state)
        tokens.block_until_ready()
        t0 = time.perf_counter()
        for _ in range(steps):
            state, tokens, _ = dec._step(dec._params, state)
        tokens.block_until_ready()
        alone.append((time.perf_counter() - t0) / steps)
        dec._state = state
    med = statistics.median
    return {
        "loop_step_us": med(loop_wall) * 1e6,
        "host_cpu_us": med(loop_cpu) * 1e6,
        "device_step_us": med(alone) * 1e6,
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ds.add_shape_args(p)
    ds.add_workload_args(p)
    g = p.add_argument_group("run")
    g.add_argument("--requests", type=int, help="default 1024 (--quick 128)")
    g.add_argument("--slots", type=int, default=32)
    g.add_argument("--callers", "--concurrency", type=int, default=64, help="closed loop")
    g.add_argument("--repeats", type=int, help="alternated runs of each (default 3, --quick 1)")
    g.add_argument("--rates", default="0.25,0.5", help="Poisson rates, as fractions of pxrt's")
    g.add_argument("--check", type=int, default=16, help="requests checked against keras-hub")
    g.add_argument("--quick", action="store_true", help="fewer requests, one repeat")
    args = p.parse_args()
    if args.requests is None:
        args.requests = 128 if args.quick else 1024
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    shape = ds.shape_from_args(args)
    work = ds.workload(args.requests, shape, args.prompts, args.outputs, args.seed)
    lengths = ds.prefill_lengths(work, shape.max_length)
    model = ds.Model(shape, args.seed)
    print(shape.describe())
    print(ds.describe_work(work, args.prompts, args.outputs))
    with tempfile.TemporaryDirectory(prefix="pxrt-gen-") as tmp:
        model.export(tmp, lengths, slots=args.slots)
        dec = model.load(args.slots)
        settle(dec, work, shape, args.callers)
        static = StaticBatcher(model, args.slots, lengths)
        print(f"{dec!r}; static batching: {args.slots} rows per batch")
        gc.collect()
        gc.freeze()
        targets = {"pxrt": dec, "static": static}
        runs: dict = {}
        checked: dict[int, list[int]] = {}

        async def pxrt_tokens(prompt, m):
            return [t async for t in dec.agenerate(prompt, max_tokens=m)]

        async def bench():
            # Warm-up: both, a few requests.
            for kind, target in targets.items():
                await closed(kind, target, work[:8], 8)
            if model.lm is not None:  # pxrt's tokens, for keras-hub's
                got = await asyncio.gather(*(pxrt_tokens(pr, m) for pr, m in work[: args.check]))
                checked.update(enumerate(got))
            for rep in range(args.repeats):
                order = list(targets) if rep % 2 == 0 else list(targets)[::-1]
                # (each run on prompts of its own: none is in pxrt's prefix cache)
                fresh = ds.fresh_tokens(work, shape, rep)
                for kind in order:
                    r = await closed(kind, targets[kind], fresh, args.callers)
                    runs.setdefault(("closed", kind), []).append(summary(r))
            rate = statistics.median(r["tok/s"] for r in runs[("closed", "pxrt")])
            mean_tokens = np.mean([min(m, dec.max_length - len(pr)) for pr, m in work])
            request_rate = rate / mean_tokens
            for frac in [float(x) for x in args.rates.split(",") if x]:
                for rep in range(args.repeats):
                    order = list(targets) if rep % 2 == 0 else list(targets)[::-1]
                    fresh = ds.fresh_tokens(work, shape, 100 + rep)
                    for kind in order:
                        r = await poisson(kind, targets[kind], fresh, frac * request_rate, rep)
                        runs.setdefault((f"poisson {frac:g}x", kind), []).append(summary(r))

        asyncio.run(bench())
        # (last: its long generations would move a decoder's learned tiers)
        switches = dec.counters.get("relayouts", 0)
        overhead = step_overhead(dec)
        dec.close()
    keras = None
    if model.lm is not None:
        keras = ds.keras_generate(model, work, args.slots)
        same, mismatches = ds.compare_tokens(checked, keras["outputs"])
    print()
    print(
        f"{'run':<16} {'':<7} {'tok/s':>9} {'steady':>9} {'ttft p50':>9} {'ttft p99':>9} "
        f"{'itl p50':>8} {'itl p99':>8}"
    )
    scenarios = dict.fromkeys(s for s, _ in runs)
    made: dict = {}  # (the closed loop's median tokens/s of each)
    for scenario in scenarios:
        med = {}
        for kind in targets:
            rows = runs[(scenario, kind)]
            med[kind] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            m = med[kind]
            print(
                f"{scenario:<16} {kind:<7} {m['tok/s']:>9.0f} {m['steady tok/s']:>9.0f} "
                f"{m['ttft p50']:>8.1f}m "
                f"{m['ttft p99']:>8.1f}m {m['itl p50']:>7.2f}m {m['itl p99']:>7.2f}m"
            )
        a, b = med["pxrt"], med["static"]
        if scenario == "closed":
            made = {kind: med[kind]["tok/s"] for kind in targets}
        print(
            f"{'':<16} {'ratio':<7} {a['tok/s'] / b['tok/s']:>8.2f}x "
            f"{a['steady tok/s'] / b['steady tok/s']:>8.2f}x "
            f"{a['ttft p50'] / b['ttft p50']:>8.2f}x {a['ttft p99'] / b['ttft p99']:>8.2f}x"
        )
        if keras is not None and scenario == "closed":
            print(
                f"{'':<16} {'keras':<7} {keras['tok/s']:>9.0f}   (keras-hub generate(), "
                f"{keras['batches']} length-sorted batches of {args.slots}, "
                f"{keras['shapes']} padded lengths): pxrt/keras-hub "
                f"{a['tok/s'] / keras['tok/s']:.2f}x"
            )
    print()
    o = overhead
    print(
        f"per step at {args.slots} busy slots: the loop's thread spends {o['host_cpu_us']:.0f} "
        f"us of CPU (dispatch, read, route, wake); the loop's step {o['loop_step_us']:.0f} us "
        f"against {o['device_step_us']:.0f} us for the step program alone "
        f"({o['loop_step_us'] / o['device_step_us']:.2f}x)"
    )
    if made:  # (the floor: the device's steps, nothing else)
        ceiling = args.slots / (o["device_step_us"] * 1e-6)
        print(
            f"the steps alone, every slot busy: {ceiling:.0f} tokens/s (no prefill, no "
            f"insert, no host work); pxrt made {made['pxrt'] / ceiling:.2f}x of it, static "
            f"batching {made['static'] / ceiling:.2f}x"
        )
    print(
        f"compiles after load: {dec.compiles_after_load}; length tiers "
        f"{tiers_text(dec.tiers) or 'none'} ({switches} switch(es))"
    )
    if keras is not None:
        print(
            f"keras-hub generate(): {same}/{len(checked)} requests token-equal with pxrt's "
            "greedy tokens",
            *mismatches,
            sep="\n",
        )
        if same != len(checked):
            sys.exit(1)


if __name__ == "__main__":
    main()
