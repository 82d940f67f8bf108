"""A keras-hub causal LM's prefill with the last position projected onto the vocabulary,
against every position's logits (what it computed before: the first token needs one).

Exports ``decoder_shapes``' keras-hub Llama (``--shape keras-llama``, any overrides:
``--vocab 32000``) twice with ``pxrt.adapters.keras_hub.export_causal_lm``: as it is,
and with ``last_logits_head`` turned off (every position's logits, the last one
taken). Then each artifact's own prefill program (read back from the artifact,
jitted, the cache built) at each ``--cells`` (batch x length), the two alternated, the
least of ``--rounds`` medians of ``--calls`` calls each; their outputs compared (the
first token's logits to float32 rounding, its greedy pick the same).

    python benchmarks/prefill_head.py [--shape keras-llama] [--vocab 4096] \\
        [--cells 1x16,1x64,4x64,1x256] [--calls 30] [--rounds 3]

On the 2-core CPU (2026-12-07), d_model 128: 0.68-0.83x the time over the cells with a
4,096 vocabulary, 0.27-0.42x with 32,000; the greedy pick the same in every cell.
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


def cells(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(b), int(n)) for b, n in (c.split("x") for c in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: BxN,BxN,... e.g. 1x16,4x64") from None


def exported(lm, directory: str, lengths: list[int], last_only: bool) -> object:
    """The artifact's prefill as it reads back (jax.export), for ``last_only`` or not."""
    with contextlib.nullcontext() if last_only else ds.keras_adapter_without("last_logits_head"):
        path = adapter.export_causal_lm(
            lm, directory, max_length=max(lengths) * 2, slots=1, prefill_lengths=lengths,
            prefill_batches=(1,),
        )  # fmt: skip
    return pxrt.decoder.read(path)


def blocking(fn, *args) -> None:
    jax.block_until_ready(fn(*args))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ds.add_shape_args(p)
    p.add_argument("--cells", type=cells, default=cells("1x16,1x64,4x64,1x256"))
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.set_defaults(shape="keras-llama")
    args = p.parse_args()
    shape = ds.shape_from_args(args)
    if shape.family != "keras-llama":
        raise SystemExit("--shape keras-llama (a keras-hub model)")
    lm = ds.keras_llama(shape)
    lengths = sorted({n for _, n in args.cells})
    tmp = tempfile.mkdtemp(prefix="pxrt-prefill-head-")
    arts = {
        name: exported(lm, os.path.join(tmp, name), lengths, name == "last")
        for name in ("all", "last")
    }
    params = jax.device_put(arts["all"].params)  # (the artifact's: its leaves)
    print(shape.describe())
    rng = np.random.default_rng(0)
    for b, n in args.cells:
        tokens = jnp.asarray(rng.integers(1, shape.vocab - 2, (b, n)), jnp.int32)
        lens = jnp.asarray(rng.integers(n // 2, n + 1, b), jnp.int32)
        run = {
            name: jax.jit(art.prefill_for(b, n).call).lower(params, tokens, lens).compile()
            for name, art in arts.items()
        }
        outs = {name: f(params, tokens, lens)[1] for name, f in run.items()}
        diff = float(jnp.max(jnp.abs(outs["last"] - outs["all"])))
        same = bool((jnp.argmax(outs["last"], -1) == jnp.argmax(outs["all"], -1)).all())
        calls = {
            name: functools.partial(blocking, f, params, tokens, lens) for name, f in run.items()
        }
        best = ds.least_medians(calls, args.rounds, args.calls)
        print(
            f"{b} x {n:>4}: every position {best['all'] * 1e3:7.3f} ms, the last "
            f"{best['last'] * 1e3:7.3f} ms ({best['last'] / best['all']:.2f}x); logits "
            f"within {diff:.1e}, greedy {'same' if same else 'DIFFERENT'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
