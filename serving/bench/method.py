"""How ``pxrt bench`` decides: when a measurement is stable, which rate is the highest
that meets a latency objective, and how two targets compare on a noisy machine.

- ``stable``: perf_analyzer's rule. Measure in windows; the measurement is the last
  three once their throughput and mean latency each agree within ``threshold`` (10%),
  and "unstable" if that has not happened after ``max_windows``.
- ``goodput``: the highest request rate whose latency percentile stays within the
  objective, by bisection over rates (perf_analyzer's latency-threshold search,
  genai-perf's goodput), each probe one open-loop run.
- ``ratio_interval``: two targets measured alternately, each repeat giving one ratio;
  the geometric mean of the ratios with a Student-t 95% interval over their logs. On a
  shared machine the drift between repeats hits both targets of a pair alike: the
  interval says whether what is left is a difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

# Student's t, two-sided 95%, by degrees of freedom (scipy is not a dependency).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # fmt: skip


def t95(dof: int) -> float:
    """Student's t quantile for a two-sided 95% interval with ``dof`` degrees of
    freedom (the nearest tabulated one at or below it; 1.96 beyond 30)."""
    if dof < 1:
        return float("inf")
    if dof > 30:
        return 1.96
    return _T95[max(k for k in _T95 if k <= dof)]


def agree(values: list[float], threshold: float) -> bool:
    """Whether ``values`` lie within ``threshold`` of each other (max / min - 1)."""
    lo, hi = min(values), max(values)
    return lo > 0 and hi / lo - 1 <= threshold


def stable(
    window: Callable[[], dict],
    *,
    threshold: float = 0.10,
    max_windows: int = 10,
    keys: tuple[str, ...] = ("requests_per_s", "mean_ms"),
) -> tuple[list[dict], bool]:
    """Call ``window()`` (one measurement window: a dict with ``keys``) until the last
    three agree on every key within ``threshold``, at most ``max_windows`` times.
    Returns the last three windows (all of them if fewer) and whether they agreed."""
    windows: list[dict] = []
    while len(windows) < max_windows:
        windows.append(window())
        last = windows[-3:]
        if len(last) == 3 and all(agree([w[k] for w in last], threshold) for k in keys):
            return last, True
    return windows[-3:], False


def goodput(
    probe: Callable[[float], float],
    objective: float,
    low: float,
    high: float,
    *,
    rel_tol: float = 0.05,
    max_probes: int = 12,
) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate in ``[low, high]`` whose ``probe(rate)`` (a latency) is at most
    ``objective``, within ``rel_tol``, by bisection (latency is taken to rise with the
    rate). Returns it (0.0 when even ``low`` misses it) and every (rate, latency) probed."""
    probed: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        latency = probe(rate)
        probed.append((rate, latency))
        return math.isfinite(latency) and latency <= objective

    if not ok(low):
        return 0.0, probed
    if ok(high):
        return high, probed
    good, bad = low, high
    while bad / good - 1 > rel_tol and len(probed) < max_probes:
        mid = math.sqrt(good * bad)  # (rates span decades: bisect their logs)
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good, probed


def ratio_interval(a: list[float], b: list[float]) -> dict[str, Any]:
    """``b / a`` from paired repeats (``a[i]`` and ``b[i]`` measured back to back): the
    geometric mean of the ratios and its 95% interval (Student-t over the logs; with
    one pair, no interval)."""
    if len(a) != len(b) or not a:
        raise ValueError("ratio_interval needs as many measurements of b as of a, at least one")
    logs = np.log(np.asarray(b, float) / np.asarray(a, float))
    mean = float(logs.mean())
    if len(logs) < 2:
        return {"ratio": math.exp(mean), "low": float("nan"), "high": float("nan"), "n": 1}
    half = t95(len(logs) - 1) * float(logs.std(ddof=1)) / math.sqrt(len(logs))
    return {
        "ratio": math.exp(mean),
        "low": math.exp(mean - half),
        "high": math.exp(mean + half),
        "n": len(logs),
    }


COMPARED = ("requests_per_s", "p50_ms", "p99_ms")


def compare_row(concurrency: int, a: list[dict], b: list[dict]) -> dict[str, Any]:
    """One concurrency's paired runs of A and B (in the order they alternated) as
    ratios B / A with intervals, for each of ``COMPARED``."""
    row: dict[str, Any] = {"concurrency": concurrency}
    for key in COMPARED:
        xs, ys = [r[key] for r in a], [r[key] for r in b]
        row[key] = {"a": xs, "b": ys, **ratio_interval(xs, ys)}
    return row


def print_compare(labels: tuple[str, str] | list[str], repeats: int, rows: list[dict]) -> None:
    print(
        f"\nB / A, {repeats} alternated repeats, 95% intervals\n  A: {labels[0]}\n  B: {labels[1]}"
    )
    print(f"{'clients':>8} {'req/s B/A':>24} {'p50 B/A':>24} {'p99 B/A':>24}")
    for row in rows:
        cells = [
            f"{row[k]['ratio']:.3f}x [{row[k]['low']:.3f}, {row[k]['high']:.3f}]" for k in COMPARED
        ]
        print(f"{row['concurrency']:>8} " + " ".join(f"{c:>24}" for c in cells))


__all__ = [
    "COMPARED",
    "agree",
    "compare_row",
    "goodput",
    "print_compare",
    "ratio_interval",
    "stable",
    "t95",
]
