"""What a step over *length tiers* would cost: the price behind the design note in
``docs/generation.md`` (the generation engine's next redesign), measured before it is
built.

A decoder's step today runs the artifact's ``decode`` over one cache of ``slots x
max_length`` positions. A tiered state would hold several caches (say 20 slots of 128
positions, 10 of 256, 2 of 512), each stepped in place by the same ``decode`` (its
length is symbolic), all in one program. This times both, in one process, alternated:
one jitted program per layout that calls ``decode`` once per tier on donated caches
and takes each row's greedy token (the shapes of ``benchmarks/decoder_shapes.py``; the
positions drawn under 100, so every layout does the same work per row).

    python benchmarks/length_tiers.py [--shape js-wide] [--repeats 2] \\
        [--layout 32x512 --layout 20x128+10x256+2x512 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decoder_shapes as ds  # noqa: E402

LAYOUTS = (
    "32x512",
    "32x128",
    "16x512",
    "24x128+8x256+4x512",
    "20x128+10x256+2x512",
    "32x128+16x256+8x512",
)


def parse(layout: str) -> list[tuple[int, int]]:
    """``"20x128+10x256"`` -> ``[(20, 128), (10, 256)]`` (slots x positions per tier)."""
    return [(int(n), int(length)) for n, length in (t.split("x") for t in layout.split("+"))]


def step_ms(shape: ds.Shape, decode, params, tiers: list[tuple[int, int]], runs: int) -> float:
    """The median time of one step over ``tiers`` (one program, caches donated)."""
    hd = shape.d_model // shape.heads

    def cache(rows: int, length: int):
        if shape.layout == "array":
            z = jnp.zeros((rows, shape.layers, length, shape.heads, hd), jnp.float32)
            return {"k": z, "v": z + 0}
        z = lambda: jnp.zeros((rows, shape.heads, length, hd), jnp.float32)  # noqa: E731
        return [{"k": z(), "v": z()} for _ in range(shape.layers)]

    def step(params, caches, positions):
        out, tokens, at = [], [], 0
        for (n, _), c in zip(tiers, caches):
            c, logits = decode(params, c, jnp.zeros(n, jnp.int32), positions[at : at + n])
            out.append(c)
            tokens.append(jnp.argmax(logits, -1))
            at += n
        return out, jnp.concatenate(tokens)

    program = jax.jit(step, donate_argnums=(1,))
    caches = [cache(n, length) for n, length in tiers]
    rows = sum(n for n, _ in tiers)
    positions = jnp.asarray(np.random.default_rng(0).integers(0, 100, rows), jnp.int32)
    caches, tokens = program(params, caches, positions)
    tokens.block_until_ready()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        caches, tokens = program(params, caches, positions)
        tokens.block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(ds.SHAPES), default="js-wide")
    p.add_argument("--layout", action="append", help=f"slots x positions per tier ({LAYOUTS})")
    p.add_argument("--repeats", type=int, default=2, help="alternated rounds")
    p.add_argument("--runs", type=int, default=60, help="steps timed per layout per round")
    args = p.parse_args()
    shape = ds.SHAPES[args.shape]
    if shape.family != "native":
        p.error("--shape: a native shape (the parametrized decoder), not " + shape.family)
    _, decode, _ = ds.native_functions(shape)
    params = jax.tree.map(jnp.asarray, ds.native_params(shape))
    layouts = args.layout or list(LAYOUTS)
    got: dict[str, list[float]] = {k: [] for k in layouts}
    for _ in range(args.repeats):
        for k in layouts:
            got[k].append(step_ms(shape, decode, params, parse(k), args.runs))
    base = float(np.median(got[layouts[0]]))
    print(
        f"{shape.name} on {jax.default_backend()}: one step, median of {args.runs} runs, "
        f"{args.repeats} alternated rounds"
    )
    print(f"{'layout':28s} {'slots':>5s} {'positions':>9s} {'ms':>16s} {'/ first':>8s}")
    for k in layouts:
        tiers = parse(k)
        ms = got[k]
        print(
            f"{k:28s} {sum(n for n, _ in tiers):5d} {sum(n * n_ for n, n_ in tiers):9d} "
            f"{min(ms):7.2f}-{max(ms):<7.2f}  {np.median(ms) / base:7.2f}x"
        )


if __name__ == "__main__":
    main()
