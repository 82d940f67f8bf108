"""Side-by-side timing: alternatives alternate call by call, so the state of a noisy
machine (and of XLA's worker threads, which sleep after a while without work) is the
same for each of them. Used by ``pxrt demo`` and ``benchmarks/compare.py``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def compare(
    alternatives: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 5,
    calls: int = 50,
    warmup: int = 5,
) -> dict[str, float]:
    """Median seconds per call of each alternative, measured alternately."""
    for fn in alternatives.values():
        for _ in range(warmup):
            fn()
    items = list(alternatives.items())
    samples: dict[str, list[float]] = {k: [] for k in alternatives}
    clock = time.perf_counter
    for r in range(rounds):
        # Rotate who goes first each round, so no alternative always follows another.
        turn = items[r % len(items) :] + items[: r % len(items)]
        for _ in range(calls):
            for name, fn in turn:
                t0 = clock()
                fn()
                samples[name].append(clock() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def fmt_time(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} us"
