"""Side-by-side timing: alternatives interleaved in rounds, so drift in a noisy
machine's speed hits all of them alike. Used by ``pxrt demo`` and ``benchmarks/``."""

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
    """Median seconds per call of each alternative, measured interleaved."""
    for fn in alternatives.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in alternatives}
    clock = time.perf_counter
    for _ in range(rounds):
        for name, fn in alternatives.items():
            for _ in range(calls):
                t0 = clock()
                fn()
                samples[name].append(clock() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def fmt_time(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} us"
