"""When an open-loop run sends its requests: arrival schedules.

A schedule is a list of send times in seconds from the run's start (and, for a trace,
each request's size in rows). The shapes people use to load inference servers:

- ``constant:RATE``: evenly spaced (perf_analyzer's ``--request-distribution constant``);
- ``poisson:RATE``: exponential gaps (perf_analyzer's ``poisson``, ``vllm bench serve``'s
  default);
- ``gamma:RATE:B``: gamma-distributed gaps with shape ``B``, the mean gap still
  ``1/RATE`` (``vllm bench serve``'s ``--burstiness``): ``B < 1`` burstier than Poisson,
  ``B = 1`` Poisson, ``B > 1`` steadier; the gaps' coefficient of variation is
  ``1/sqrt(B)``;
- ``ramp:FROM:TO``: a Poisson process whose rate rises linearly from ``FROM`` to ``TO``
  over the run;
- ``trace:FILE``: replayed from a file: JSON lines with ``timestamp`` (milliseconds from
  the start, as genai-perf's and AIPerf's traces) and optionally ``rows``, or
  perf_analyzer's request-intervals file (one gap in microseconds per line).

``parse`` reads these specs; ``Schedule.times`` gives the send times for a run of
``duration`` seconds (a trace: its own length, cut at ``duration``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

KINDS = ("constant", "poisson", "gamma", "ramp", "trace")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """An arrival schedule (see the module); ``rate`` is the mean requests per second
    (a ramp's start, a trace's own)."""

    kind: str
    rate: float
    end_rate: float = 0.0  # ramp: the rate at the end
    burstiness: float = 1.0  # gamma: the gaps' shape
    trace: tuple[float, ...] = ()  # trace: send times (s)
    rows: tuple[int, ...] = ()  # trace: each request's rows (empty: the run's)
    source: str = ""  # trace: the file

    @property
    def label(self) -> str:
        if self.kind == "gamma":
            return f"gamma arrivals (burstiness {self.burstiness:g}) at {self.rate:,.0f} req/s"
        if self.kind == "ramp":
            return f"arrivals ramping {self.rate:,.0f} -> {self.end_rate:,.0f} req/s"
        if self.kind == "trace":
            return f"trace {os.path.basename(self.source)} ({len(self.trace)} requests)"
        name = "Poisson" if self.kind == "poisson" else self.kind
        return f"{name} arrivals at {self.rate:,.0f} req/s"

    def at(self, rate: float) -> Schedule:
        """The same shape at another mean rate (a ramp keeps its ratio; a trace is
        replayed faster or slower)."""
        if self.kind == "trace":
            scale = self.rate / rate
            return dataclasses.replace(self, rate=rate, trace=tuple(t * scale for t in self.trace))
        end = self.end_rate * rate / self.rate if self.kind == "ramp" else 0.0
        return dataclasses.replace(self, rate=rate, end_rate=end)

    def times(self, duration: float, seed: int = 0) -> np.ndarray:
        """Send times in seconds from the start, ascending, all below ``duration``. For
        constant, Poisson and gamma arrivals the first is at 0 (as vLLM's benchmark
        sends its first request at once): such a run is never empty, however low its
        rate."""
        rng = np.random.default_rng(seed)
        if self.kind == "trace":
            times = np.asarray(self.trace, float)
            return times[times < duration]
        if self.kind == "ramp":
            return _ramp(self.rate, self.end_rate, duration, rng)
        n = int(self.rate * duration * 1.2) + 16  # enough gaps, cut below

        def gaps() -> np.ndarray:
            if self.kind == "constant":
                return np.full(n, 1.0 / self.rate)
            if self.kind == "poisson":
                return rng.exponential(1.0 / self.rate, n)
            b = self.burstiness  # gamma
            return rng.gamma(b, 1.0 / (self.rate * b), n)

        times = np.concatenate([[0.0], np.cumsum(gaps())])
        while times[-1] < duration:  # (rare: a slow draw)
            times = np.concatenate([times, times[-1] + np.cumsum(gaps())])
        return times[times < duration]


def _ramp(r0: float, r1: float, duration: float, rng: np.random.Generator) -> np.ndarray:
    """A Poisson process with rate ``r0 + (r1 - r0) t / duration``: unit-rate arrivals
    mapped through the inverse of the cumulative rate."""
    slope = (r1 - r0) / duration
    total = r0 * duration + slope * duration**2 / 2
    units = np.cumsum(rng.exponential(1.0, int(total * 1.2) + 16))
    units = units[units < total]
    if abs(slope) < 1e-12:
        return units / r0
    # solve r0 t + slope t^2 / 2 = u for t >= 0
    return (-r0 + np.sqrt(r0 * r0 + 2 * slope * units)) / slope


def parse(spec: str) -> Schedule:
    """A schedule from its spec (``poisson:200``, ``gamma:200:0.5``, ``ramp:100:800``,
    ``trace:FILE``...); ValueError naming what is wrong."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"arrival schedule {spec!r}: expected one of {', '.join(KINDS)}")
    if kind == "trace":
        if not rest:
            raise ValueError("trace needs a file: trace:FILE")
        return read_trace(rest)
    parts = rest.split(":") if rest else []
    want = {"constant": 1, "poisson": 1, "gamma": 2, "ramp": 2}[kind]
    if len(parts) != want:
        example = {"constant": "constant:200", "poisson": "poisson:200",
                   "gamma": "gamma:200:0.5", "ramp": "ramp:100:800"}[kind]  # fmt: skip
        raise ValueError(f"arrival schedule {spec!r}: expected {example}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"arrival schedule {spec!r}: the numbers are not numbers") from None
    if not all(np.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"arrival schedule {spec!r}: rates and burstiness must be > 0")
    if kind == "gamma":
        return Schedule(kind, values[0], burstiness=values[1])
    if kind == "ramp":
        return Schedule(kind, values[0], end_rate=values[1])
    return Schedule(kind, values[0])


def with_rate(spec: str, rate: float) -> str:
    """``spec``'s shape at ``rate`` (``--arrival gamma::0.5`` and ``--request-rate 200``
    make ``gamma:200:0.5``): the rate field filled in, or replaced."""
    kind, _, rest = spec.partition(":")
    if kind in ("trace", "ramp"):
        return spec
    parts = rest.split(":") if rest else [""]
    parts[0] = f"{rate:g}"
    if kind == "gamma" and len(parts) == 1:
        parts.append("1")
    return ":".join([kind, *parts])


def plans(spec: str, rates: list[float] | None, default_rate: float) -> list[Schedule]:
    """The open-loop runs of ``--arrival spec --request-rate rates``: the shape of
    ``spec`` at each rate; without rates, at the rate ``spec`` names (``poisson:200``,
    a ramp's, a trace's own), else at ``default_rate``. ``spec`` may leave the rate out
    (``poisson``, ``gamma::0.5``)."""
    kind, _, rest = spec.partition(":")
    named = kind in ("trace", "ramp") or bool(rest.split(":")[0])
    shape = parse(spec if named else with_rate(spec, 1.0))
    if rates:
        return [shape.at(r) for r in rates]
    return [shape if named else shape.at(default_rate)]


def parse_lengths(spec: str, top: int, what: str = "--lengths") -> Any:
    """``"pareto:LOW:HIGH"`` (long-tailed, as text lengths are: most short, a few
    long), ``"uniform:LOW:HIGH"`` or ``"fixed:N"`` -> ``draw(n, seed)`` giving ``n``
    lengths, clipped to ``top``."""
    kind, _, rest = spec.partition(":")
    try:
        values = [int(v) for v in rest.split(":")] if rest else []
    except ValueError:
        values = []
    if kind == "fixed" and len(values) == 1 and values[0] >= 1:
        return lambda n, seed: np.full(n, min(values[0], top), np.int64)
    if kind in ("pareto", "uniform") and len(values) == 2 and 1 <= values[0] <= values[1]:
        low, high = min(values[0], top), min(values[1], top)
        if kind == "uniform":
            return lambda n, seed: np.random.default_rng(seed).integers(low, high, n, endpoint=True)

        def pareto(n: int, seed: int) -> np.ndarray:
            draws = low * (1.0 + np.random.default_rng(seed).pareto(1.2, n))
            return np.clip(np.round(draws), low, high).astype(np.int64)

        return pareto
    raise ValueError(
        f"{what} {spec!r}: expected pareto:LOW:HIGH, uniform:LOW:HIGH or fixed:N "
        "(positive ints, LOW <= HIGH)"
    )


def read_trace(path: str) -> Schedule:
    """A trace file (see the module) as a schedule; ValueError naming the bad line."""
    times: list[float] = []
    rows: list[int] = []
    try:
        with open(path) as f:
            lines = [(i, line.strip()) for i, line in enumerate(f, 1) if line.strip()]
    except OSError as exc:
        raise ValueError(f"trace {path}: {exc}") from None
    if not lines:
        raise ValueError(f"trace {path}: no requests in it")
    jsonl = lines[0][1].startswith("{")
    at = 0.0
    for i, line in lines:
        try:
            if jsonl:
                doc = json.loads(line)
                t = float(doc["timestamp"]) / 1e3
                if "rows" in doc:
                    rows.append(int(doc["rows"]))
            else:
                at += float(line) / 1e6
                t = at
        except (ValueError, KeyError, TypeError) as exc:
            what = "a JSON object with timestamp (ms)" if jsonl else "an interval in us"
            raise ValueError(f"trace {path} line {i}: expected {what} ({exc})") from None
        if not np.isfinite(t) or t < 0 or (times and t < times[-1]):
            raise ValueError(f"trace {path} line {i}: times must be >= 0 and not decrease")
        times.append(t)
    if rows and len(rows) != len(times):
        raise ValueError(f"trace {path}: give rows for every request or for none")
    if rows and min(rows) < 1:
        raise ValueError(f"trace {path}: rows must be >= 1")
    span = times[-1] - times[0]
    rate = (len(times) - 1) / span if span > 0 else float(len(times))
    return Schedule("trace", rate, trace=tuple(times), rows=tuple(rows), source=path)


__all__ = ["KINDS", "Schedule", "parse", "parse_lengths", "plans", "read_trace", "with_rate"]
