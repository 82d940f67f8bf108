"""What ``pxrt.per_slot`` costs: a decode step written for one sequence and run per slot
under ``jax.vmap``, against the same math written for every slot (a per-row scatter).

The demo decoder's ``lm_decode`` is already written for every slot; ``per_slot`` of the
same function gives it one slot at a time (a batch of one) and vmaps over the slots, as a
library step that writes at one cache index would be run. Both compute the same tokens.
Two figures, the variants alternated ``--repeats`` times, medians and the ratio:

- the device work alone: each variant's jitted decode step over ``--slots`` slots of a
  ``--max-length`` cache, called back to back (the cache donated, as pxrt does);
- end to end: each variant exported and loaded as a pxrt decoder, ``--slots`` prompts
  generating ``--tokens`` tokens each at once: output tokens per second.

Varied over model width and slot count (``--dims``, ``--slot-counts``).

    python benchmarks/per_slot.py [--repeats 5] [--dims 64,128] [--slot-counts 8,32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402


def step_time(decode, params, slots: int, max_length: int, dim: int, n: int = 50) -> float:
    """Seconds per call of the jitted step, the cache donated through the calls."""
    cache = {
        k: jnp.zeros((slots, demo.LM_LAYERS, max_length, demo.LM_HEADS, dim // demo.LM_HEADS))
        for k in ("k", "v")
    }
    step = jax.jit(decode, donate_argnums=(1,))
    tokens = jnp.arange(slots, dtype=jnp.int32) % 200
    positions = (jnp.arange(slots, dtype=jnp.int32) * 7) % (max_length - 1)
    cache, logits = step(params, cache, tokens, positions)
    logits.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(n):
        cache, logits = step(params, cache, tokens, positions)
    logits.block_until_ready()
    return (time.perf_counter() - t0) / n


def tokens_per_s(path: str, slots: int, tokens: int) -> float:
    with pxrt.load(path, progress=False) as dec:
        prompts = demo.lm_prompts(slots, seed=3, low=4, high=16)
        dec.generate(prompts[0], max_tokens=2)  # warm
        t0 = time.perf_counter()
        streams = [dec.submit(p, max_tokens=tokens, stop_ids=()) for p in prompts]
        n = sum(len(s.result().tokens) for s in streams)
        return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--slot-counts", default="8,32")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {len(jax.devices())} device(s)")
    print(f"{'dim':>4} {'slots':>5} | {'step: scatter':>13} {'per_slot':>9} {'ratio':>6} |"
          f" {'tok/s: scatter':>14} {'per_slot':>9} {'ratio':>6}")  # fmt: skip
    variants = {"scatter": demo.lm_decode, "per_slot": pxrt.per_slot(demo.lm_decode)}
    with tempfile.TemporaryDirectory() as tmp:
        for dim in [int(d) for d in args.dims.split(",")]:
            params = demo.make_lm_params(dim=dim)
            for slots in [int(s) for s in args.slot_counts.split(",")]:
                paths = {}
                for name, decode in variants.items():
                    paths[name] = pxrt.export_decoder(
                        demo.lm_prefill, decode, params, os.path.join(tmp, f"{name}{dim}_{slots}"),
                        cache=demo.lm_cache_spec(dim=dim), max_length=args.max_length,
                        slots=slots, prefill_lengths=(16,), prefill_batches=(1,),
                    )  # fmt: skip
                steps: dict[str, list[float]] = {k: [] for k in variants}
                rates: dict[str, list[float]] = {k: [] for k in variants}
                for _ in range(args.repeats):
                    for name, decode in variants.items():
                        steps[name].append(step_time(decode, params, slots, args.max_length, dim))
                        rates[name].append(tokens_per_s(paths[name], slots, args.tokens))
                s = {k: statistics.median(v) for k, v in steps.items()}
                r = {k: statistics.median(v) for k, v in rates.items()}
                print(
                    f"{dim:>4} {slots:>5} | {s['scatter'] * 1e3:>11.3f}ms "
                    f"{s['per_slot'] * 1e3:>7.3f}ms {s['per_slot'] / s['scatter']:>5.2f}x | "
                    f"{r['scatter']:>14.0f} {r['per_slot']:>9.0f} "
                    f"{r['per_slot'] / r['scatter']:>5.2f}x"
                )


if __name__ == "__main__":
    main()
