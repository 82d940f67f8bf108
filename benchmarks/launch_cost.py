"""What launching a compiled program costs the host on this device, by argument count.

A program that adds one to each of ``n`` small donated arrays (a decoder's state), and
one that reads ``n`` weights beside one donated array (its params): per call, the
dispatch alone, the dispatch and the wait for the result (a loop that reads each
step's tokens before the next), and the rate of calls queued back to back with one
wait at the end (a loop that keeps programs in flight). The least of three medians of
300 calls each.

    python benchmarks/launch_cost.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def bench(compiled, args: tuple, n: int = 300) -> str:
    rows = []
    held = args
    for _ in range(3):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            out = compiled(*held)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            times.append((t1 - t0, time.perf_counter() - t0))
            held = (held[0], out) if isinstance(held[0], tuple) else out
        t0 = time.perf_counter()
        for _ in range(n):
            out = compiled(*held)
            held = (held[0], out) if isinstance(held[0], tuple) else out
        jax.block_until_ready(out)
        queued = (time.perf_counter() - t0) / n
        rows.append(
            (statistics.median(t[0] for t in times), statistics.median(t[1] for t in times), queued)
        )
    call, wait, queued = (1e6 * v for v in min(rows, key=lambda r: r[1]))
    return f"dispatch {call:.0f} us, dispatch and wait {wait:.0f} us, queued {queued:.0f} us a call"


def main() -> None:
    print(jax.devices()[0].device_kind, jax.devices()[0].platform)
    for n in (1, 4, 16, 64):
        state = tuple(jnp.zeros((16, 128), jnp.float32) + i for i in range(n))
        add = jax.jit(lambda *a: tuple(x + 1 for x in a), donate_argnums=tuple(range(n)))
        print(f"{n:>3} donated arrays: {bench(add.lower(*state).compile(), state)}", flush=True)
    for n in (1, 4, 16, 64):
        weights = tuple(jnp.ones((128, 128), jnp.float32) for _ in range(n))

        def read(ws, s):
            for w in ws:
                s = s + w[:16]
            return s

        s = jnp.zeros((16, 128), jnp.float32)
        compiled = jax.jit(read, donate_argnums=(1,)).lower(weights, s).compile()
        print(f"{n:>3} weights + 1 donated: {bench(compiled, (weights, s))}", flush=True)


if __name__ == "__main__":
    main()
