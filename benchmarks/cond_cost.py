"""What a ``lax.cond`` costs a program on this backend, whatever its branches.

One program: logits of ``--rows`` x ``--vocab`` from a product of width 256, then the
greedy pick (``pxrt.sampling.greedy``); the same with the pick under a ``lax.cond`` whose
other branch (never taken: every row is greedy) is each of: ``most + 1``, an exp, a
cumsum, a random draw, a sort; and ``pxrt.sampling.sample`` (the decoder's choice on
greedy rows). Synchronous dispatch (``jax_cpu_enable_async_dispatch`` off: the host waits
in the call, so the thread hand-off is not measured); medians of ``--calls``, rounds
alternated. On the 2-core CPU (2026-12-07): 16-21 us for the pick alone, 35-90 us with
any of the branches; on a TPU the decoder's programs cost the same with or without.

    python benchmarks/cond_cost.py [--rows 4] [--vocab 258] [--calls 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from pxrt import sampling  # noqa: E402


def programs(vocab: int) -> dict:
    def branches(logits, most, seed, position) -> dict:
        def draw(_):
            key = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)
            u = jax.vmap(lambda k: jax.random.uniform(k, ()))(key)
            return jnp.floor(u * vocab).astype(jnp.int32)

        return {
            "most + 1": lambda _: most + 1,
            "exp": lambda _: jnp.argmin(jnp.exp(logits) * 3.0, axis=-1).astype(jnp.int32),
            "cumsum": lambda _: (jnp.cumsum(jnp.exp(logits), -1) < 5.0).sum(-1).astype(jnp.int32),
            "draw": draw,
            "sort": lambda _: jnp.sort(logits, -1)[:, 3].astype(jnp.int32),
        }

    def build(name: str):
        def f(x, w, temperature, seed, position):
            logits = x @ w
            most = sampling.greedy(logits)
            if name == "pick alone":
                return most
            if name == "sample":
                top_k, top_p = jnp.zeros_like(position), jnp.ones_like(temperature)
                return sampling.sample(logits, temperature, top_k, top_p, seed, position)
            sampled = temperature >= sampling.MIN_TEMPERATURE
            other = branches(logits, most, seed, position)[name]
            drawn = lax.cond(jnp.any(sampled), other, lambda _: most, None)
            return jnp.where(sampled, drawn, most)

        return jax.jit(f)

    names = ["pick alone", "most + 1", "exp", "cumsum", "draw", "sort", "sample"]
    return {name: build(name) for name in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--vocab", type=int, default=258)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    rng = np.random.default_rng(0)
    n = args.rows
    inputs = (
        jnp.asarray(rng.normal(size=(n, 256)).astype(np.float32)),
        jnp.asarray(rng.normal(size=(256, args.vocab)).astype(np.float32)),
        jnp.zeros(n, jnp.float32),  # every row greedy
        jnp.zeros(n, jnp.uint32),
        jnp.zeros(n, jnp.int32),
    )
    progs = programs(args.vocab)
    want = np.asarray(progs["pick alone"](*inputs))
    for name, f in progs.items():  # (compiled, warm, and the same tokens)
        assert (np.asarray(f(*inputs)) == want).all(), name

    def timed(f) -> float:
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            f(*inputs).block_until_ready()
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e6

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {n} x {args.vocab} logits")
    for r in range(args.rounds):
        order = list(progs) if r % 2 == 0 else list(progs)[::-1]
        got = {name: timed(progs[name]) for name in order}
        print(f"round {r}: " + ", ".join(f"{k} {got[k]:.0f} us" for k in progs), flush=True)


if __name__ == "__main__":
    main()
