"""Load generation on the event loop: closed-loop callers, open-loop Poisson arrivals, the
event-loop lag monitor, and the row of the report that one run makes.

Everything here drives an ``infer(request)`` coroutine function, whatever serves it: a
``serving.Server``, a baseline batcher, or an HTTP client.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99, 99.9)

# perf_counter, not loop.time(): on uvloop the loop clock moves in whole milliseconds.
clock = time.perf_counter


def latency_stats(latencies_s: list[float]) -> dict:
    """p50..p99.9 and the mean, in milliseconds."""
    if not latencies_s:
        return {f"p{p}_ms": float("nan") for p in PERCENTILES} | {"mean_ms": float("nan")}
    arr = np.asarray(latencies_s) * 1e3
    return {f"p{p}_ms": float(np.percentile(arr, p)) for p in PERCENTILES} | {
        "mean_ms": float(arr.mean())
    }


def run_result(
    mode: str, label: str, latencies: list[float], rows: int, seconds: float, **extra: Any
) -> dict:
    """One run's row of the report: rates, latency percentiles, and whatever else."""
    return {
        "mode": mode,
        "label": label,
        "requests_per_s": len(latencies) / seconds,
        "rows_per_s": len(latencies) * rows / seconds,
        **latency_stats(latencies),
        **extra,
        "latencies_ms": _sample(latencies),
    }


def merge_windows(windows: list[dict]) -> dict:
    """Runs of the same kind as one: rates averaged, percentiles over every latency
    sample kept, the stage breakdown of the last."""
    merged = dict(windows[-1])
    merged["requests_per_s"] = float(np.mean([w["requests_per_s"] for w in windows]))
    merged["rows_per_s"] = float(np.mean([w["rows_per_s"] for w in windows]))
    samples = [v / 1e3 for w in windows for v in w["latencies_ms"]]
    stats = run_result("", "", samples, 1, 1.0)
    for key in stats:
        if key.endswith("_ms") and key != "latencies_ms":
            merged[key] = stats[key]
    merged["windows"] = len(windows)
    return merged


def p99_ms(samples: list[float]) -> float:
    return float(np.percentile(samples, 99) * 1e3) if samples else float("nan")


def _sample(latencies_s: list[float], n: int = 4000) -> list[float]:
    """Up to n latencies in ms (evenly strided), enough for a CDF plot."""
    arr = np.sort(np.asarray(latencies_s)) * 1e3
    if len(arr) > n:
        arr = arr[np.linspace(0, len(arr) - 1, n).astype(int)]
    return [round(float(v), 4) for v in arr]


async def closed_loop(
    infer: Callable[[Any], Awaitable[Any]],
    request: Any,
    concurrency: int,
    duration: float,
    *,
    count_errors: bool = False,
) -> tuple[list[float], float, int]:
    """``concurrency`` callers, each awaiting ``infer(request)`` back to back for
    ``duration`` seconds (a list of requests: each call takes the next, round robin).
    Returns the latencies (s), the elapsed time and the errors (only counted with
    ``count_errors``; otherwise an error propagates)."""
    latencies: list[float] = []
    errors = 0
    deadline = clock() + duration
    pick = _picker(request)

    async def caller() -> None:
        nonlocal errors
        append = latencies.append
        while clock() < deadline:
            t0 = clock()
            if count_errors:
                try:
                    await infer(pick())
                except Exception:  # noqa: BLE001 - counted
                    errors += 1
                    continue
            else:
                await infer(pick())
            append(clock() - t0)

    t0 = clock()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return latencies, clock() - t0, errors


def _picker(request: Any) -> Callable[[], Any]:
    """The request for each call: the same one, or the next of a list."""
    if isinstance(request, list):
        return itertools.cycle(request).__next__
    return lambda: request


async def poisson_arrivals(rate: float, duration: float, seed: int) -> AsyncIterator[float]:
    """Yield scheduled arrival times (perf_counter) of a Poisson process for ``duration``
    seconds, sleeping until each. A late loop yields the missed arrivals at once: latency
    measured from the scheduled time then includes the lateness, as it should."""
    rng = np.random.default_rng(seed)
    start = at = clock()
    while at - start < duration:
        at += rng.exponential(1.0 / rate)
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        yield at


async def open_loop(
    submit: Callable[[Any], asyncio.Future], request: Any, rate: float, duration: float
) -> tuple[list[float], int]:
    """Poisson arrivals at ``rate``; each arrival is ``submit(request)`` (the next of
    a list of requests, round robin), a future. One
    callback per request and no task: the generator itself must cost the loop little,
    or it, not the server, sets the rate it can offer. Returns latencies from each
    request's scheduled arrival, and the number of errors."""
    latencies: list[float] = []
    errors = 0
    outstanding = 0
    all_done = asyncio.Event()
    generating = True

    def done(fut: asyncio.Future, scheduled: float) -> None:
        nonlocal errors, outstanding
        if fut.cancelled() or fut.exception() is not None:
            errors += 1
        else:
            latencies.append(clock() - scheduled)
        outstanding -= 1
        if not outstanding and not generating:
            all_done.set()

    pick = _picker(request)
    async for at in poisson_arrivals(rate, duration, seed=4):
        outstanding += 1
        submit(pick()).add_done_callback(functools.partial(done, scheduled=at))
    generating = False
    if outstanding:
        await all_done.wait()
    return latencies, errors


LATE_S = 2e-3  # sent this much after its scheduled time: late (uvloop timers tick per ms)


class Records:
    """Per-request records of an open-loop run: when each was scheduled and sent and
    when its answer came (seconds from the run's start; ``done`` is NaN for an error,
    whose kind is in ``errors``)."""

    __slots__ = ("scheduled", "sent", "done", "errors", "rows")

    def __init__(self, n: int) -> None:
        self.scheduled = np.full(n, np.nan)
        self.sent = np.full(n, np.nan)
        self.done = np.full(n, np.nan)
        self.errors: dict[int, str] = {}
        self.rows = np.zeros(n, np.int64)

    @property
    def ok(self) -> np.ndarray:
        return ~np.isnan(self.done)

    def start(self) -> np.ndarray:
        """When each request's latency is timed from: its scheduled send, or its actual
        send if the loop's timer (1 ms ticks on uvloop) let it go a little early."""
        return np.fmax(self.scheduled, self.sent)

    def latencies(self) -> list[float]:
        """Seconds from each successful request's scheduled send (``start``) to its
        answer."""
        ok = self.ok
        return (self.done[ok] - self.start()[ok]).tolist()

    def late_share(self) -> float:
        """The share of requests sent over ``LATE_S`` after their scheduled time: the
        load generator could not keep up with the schedule."""
        sent = ~np.isnan(self.sent)
        if not sent.any():
            return 0.0
        return float(np.mean(self.sent[sent] - self.scheduled[sent] > LATE_S))

    def rows_of(self) -> list[dict]:
        """One dict per request (the JSON lines of ``--records``)."""
        out = []
        start = self.start()
        for i in range(len(self.scheduled)):
            row: dict[str, Any] = {
                "scheduled_s": round(float(self.scheduled[i]), 6),
                "sent_s": round(float(self.sent[i]), 6),
                "rows": int(self.rows[i]),
            }
            if i in self.errors:
                row["error"] = self.errors[i]
            else:
                row["done_s"] = round(float(self.done[i]), 6)
                row["latency_ms"] = round(float(self.done[i] - start[i]) * 1e3, 4)
            out.append(row)
        return out


async def scheduled_run(
    submit: Callable[[Any], Any], requests: Any, times: np.ndarray, rows: Any = None
) -> tuple[Records, float]:
    """Send ``submit(request)`` (a future or a coroutine) at each of ``times`` (seconds
    from now; the next of a list of requests each time) and wait for every answer.
    Latency is timed from the scheduled send, so a generator that falls behind shows
    up in the latencies and in ``Records.late_share``, not as a lighter load. One
    callback per request (a coroutine gets a task). ``rows``: each request's rows, or
    one count for all (for the records). Returns the records and the time from the
    start to the last answer."""
    n = len(times)
    records = Records(n)
    if rows is not None:
        records.rows[:] = rows
    if not n:
        return records, 0.0
    pick = _picker(requests)
    outstanding = 0
    all_done = asyncio.Event()
    generating = True
    start = clock()

    def done(fut: asyncio.Future, i: int) -> None:
        nonlocal outstanding
        if fut.cancelled():
            records.errors[i] = "cancelled"
        elif fut.exception() is not None:
            exc = fut.exception()
            records.errors[i] = f"{type(exc).__name__}: {exc}"[:200]
        else:
            records.done[i] = clock() - start
        outstanding -= 1
        if not outstanding and not generating:
            all_done.set()

    for i, at in enumerate(times):
        delay = start + at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        records.scheduled[i] = at
        records.sent[i] = clock() - start
        outstanding += 1
        fut = asyncio.ensure_future(submit(pick()))
        fut.add_done_callback(functools.partial(done, i=i))
    generating = False
    if outstanding:
        await all_done.wait()
    return records, clock() - start


class LagMonitor:
    """Every ``period``, times one trip around the loop (``sleep(0)``): how long anything
    that becomes ready waits for the loop. Timer granularity (1 ms in uvloop) does not
    enter it. Use as ``async with LagMonitor() as lag: ...``; then ``lag.p99_ms``."""

    def __init__(self, period: float = 1e-3) -> None:
        self.period = period
        self.lags: list[float] = []
        self._stop = False
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while not self._stop:
            await asyncio.sleep(self.period)
            t0 = clock()
            await asyncio.sleep(0)
            self.lags.append(clock() - t0)

    async def __aenter__(self) -> LagMonitor:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._stop = True
        if self._task is not None:
            await self._task

    @property
    def p99_ms(self) -> float:
        return p99_ms(self.lags)
