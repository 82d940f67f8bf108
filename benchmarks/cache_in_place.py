"""A keras-hub causal LM's decode with its cache written in place, against the decode as
keras-hub's ``call_with_cache`` traces (the cache sliced apart, written, stacked back;
each key and value head repeated for its query heads).

Exports ``decoder_shapes``' keras-hub Llama (``--shape keras-llama``, any overrides)
twice with ``pxrt.adapters.keras_hub.export_causal_lm``: as it is, and with
``pxrt.adapters._inplace.in_place`` turned off. Then each artifact's own decode program
(read back from the artifact, jitted, the cache donated) over ``--slots`` slots at
each cache length of ``--lengths``, each slot at its own position, the two alternated,
the least of ``--rounds`` medians of ``--calls`` calls each; their outputs compared
(logits to float32 rounding, the greedy pick the same, the caches equal but at the
written positions).

    python benchmarks/cache_in_place.py [--shape keras-llama] [--slots 8] \\
        [--lengths 128,256,512] [--calls 40] [--rounds 3]

On the 2-core CPU (2026-12-07), keras-llama at 8 slots: 0.82x / 0.66x / 0.54x the time
at 128 / 256 / 512 positions (``--rounds 6``; the cache's writes alone, before the
repeats were read grouped: 0.83x / 0.70x / 0.79x); logits within 3e-6, the greedy pick
the same, the cache's other entries equal.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import decoder_shapes as ds  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pxrt  # noqa: E402
from pxrt.adapters import keras_hub as adapter  # noqa: E402


def exported(lm, directory: str, slots: int, in_place: bool) -> object:
    """The artifact as it reads back (jax.export), its decode in place or not."""
    with contextlib.nullcontext() if in_place else ds.keras_adapter_without("in_place"):
        path = adapter.export_causal_lm(
            lm, directory, max_length=512, slots=slots, prefill_lengths=(16,),
            prefill_batches=(1,),
        )  # fmt: skip
    return pxrt.decoder.read(path)


def step(decode, state: dict, name: str, params, tokens, positions) -> None:
    """One decode of ``name``'s cache in ``state`` (donated: the new one kept)."""
    state[name], logits = decode(params, state[name], tokens, positions)
    jax.block_until_ready(logits)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ds.add_shape_args(p)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--lengths", default="128,256,512")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.set_defaults(shape="keras-llama")
    args = p.parse_args()
    shape = ds.shape_from_args(args)
    if shape.family != "keras-llama":
        raise SystemExit("--shape keras-llama (a keras-hub model)")
    lm = ds.keras_llama(shape)
    tmp = tempfile.mkdtemp(prefix="pxrt-cache-in-place-")
    arts = {
        name: exported(lm, os.path.join(tmp, name), args.slots, name == "in place")
        for name in ("copied", "in place")
    }
    params = jax.device_put(arts["copied"].params)
    spec = adapter.cache_spec(lm)
    print(shape.describe())
    rng = np.random.default_rng(0)
    n = args.slots
    for length in (int(x) for x in args.lengths.split(",")):
        shape_of = adapter._empty_cache(spec, n, length).shape
        cache = rng.standard_normal(shape_of).astype(np.float32)
        tokens = jnp.asarray(rng.integers(1, shape.vocab - 2, n), jnp.int32)
        positions = jnp.asarray(rng.integers(0, length, n), jnp.int32)
        run = {
            name: jax.jit(art.decode.call, donate_argnums=(1,))
            .lower(params, {"kv": jnp.asarray(cache)}, tokens, positions)
            .compile()
            for name, art in arts.items()
        }
        outs = {
            name: f(params, {"kv": jnp.asarray(cache)}, tokens, positions)
            for name, f in run.items()
        }
        (kv_a, logits_a), (kv_b, logits_b) = outs["copied"], outs["in place"]
        diff = float(jnp.max(jnp.abs(logits_a - logits_b)))
        same = bool((jnp.argmax(logits_a, -1) == jnp.argmax(logits_b, -1)).all())
        kept = np.ones(shape_of, bool)
        kept[np.arange(n), ..., np.asarray(positions), :, :] = False
        unchanged = np.array_equal(np.asarray(kv_a["kv"])[kept], np.asarray(kv_b["kv"])[kept])
        state = {name: {"kv": jnp.asarray(cache)} for name in run}
        calls = {
            name: functools.partial(step, run[name], state, name, params, tokens, positions)
            for name in run
        }
        best = ds.least_medians(calls, args.rounds, args.calls)
        print(
            f"{n} slots x {length:>4}: copied {best['copied'] * 1e3:6.3f} ms, in place "
            f"{best['in place'] * 1e3:6.3f} ms ({best['in place'] / best['copied']:.2f}x); "
            f"logits within {diff:.1e}, greedy {'same' if same else 'DIFFERENT'}, the rest "
            f"of the cache {'equal' if unchanged else 'DIFFERENT'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
