"""``pxrt bench`` for a model with named dimensions: variable-length requests.

Requests draw their lengths from a distribution (``--lengths``, long-tailed by default)
and run through ``serving.Server`` four ways, alternated in one process:

- ``grid``: the model's cells, lanes chosen by measured cost (``cell_policy="cost"``);
- ``oldest``: the same cells, the oldest request's lane first, nothing rides along;
- ``padded``: every request padded to the longest length (the model loaded with only
  that length): what serving without length buckets costs;
- ``jit``: what one writes without pxrt: ``jax.jit`` called on each request's own shape
  from a thread pool; every new shape compiles on the request path.

First closed loop (``concurrency`` callers: the saturated rate), then open-loop Poisson
arrivals at half the grid's saturated rate (``grid`` vs ``oldest``: the tail latency of
the cell choice).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Any

import jax
import numpy as np

import pxrt

from ..engine.server import new_event_loop
from . import loadgen, report
from .inprocess import _on_server
from .schedule import parse_lengths


def make_requests(model: pxrt.Model, lengths: np.ndarray, rows: int, seed: int) -> list[dict]:
    """One request per length: every named dimension at that length, valid inputs (bool
    inputs all True: a mask with every token present)."""
    out = []
    for i, length in enumerate(lengths):
        at = dict.fromkeys(model.dim_names, int(length))
        request = pxrt.example_inputs(model.inputs, rows, seed=seed + i, lengths=at)
        for name, spec in model.inputs.items():
            if spec.dtype == np.bool_:
                request[name] = np.ones_like(request[name])
            elif np.issubdtype(spec.dtype, np.integer):
                request[name] = np.abs(request[name]) % 64  # in range of any vocabulary
        out.append(request)
    return out


def _stats(lengths: np.ndarray) -> dict:
    return {"median_length": float(np.median(lengths)), "max_length": int(lengths.max())}


async def _closed(model, options, requests, concurrency, duration, mode, label):
    (latencies, elapsed, _), stats = await _on_server(
        model,
        options,
        lambda server: loadgen.closed_loop(
            functools.partial(server.infer, "bench"), requests, concurrency, duration
        ),
    )
    return loadgen.run_result(mode, label, latencies, 1, elapsed, concurrency=concurrency, **stats)


async def _open(model, options, requests, rate, duration, mode, label):
    (latencies, errors), stats = await _on_server(
        model,
        options,
        lambda server: loadgen.open_loop(
            functools.partial(server.submit, "bench"), requests, rate, duration
        ),
    )
    return loadgen.run_result(
        mode, label, latencies, 1, duration, offered_per_s=rate, errors=errors, **stats
    )


def exported_fn(model: pxrt.Model) -> Any:
    """``fn(params, **inputs)`` of an artifact, from its exported program (for the
    ``jit`` baseline when the Python function is not at hand)."""
    exported, names = model.artifact.exported, list(model.inputs)

    def fn(params: Any, **inputs: Any) -> Any:
        return exported.call(params, *[inputs[n] for n in names])

    return fn


def run_jit(model: pxrt.Model, fn: Any, requests: list[dict], threads: int, duration: float):
    """``jax.jit(fn)`` on each request's own shape from ``threads`` threads, closed loop:
    what serving looks like without pxrt. Counts the shapes it compiled."""
    jitted = jax.jit(fn)
    params = model.artifact.params
    latencies: list[float] = []
    shapes: set = set()
    lock = threading.Lock()
    deadline = loadgen.clock() + duration
    counter = iter(range(1 << 62))

    def worker() -> None:
        while loadgen.clock() < deadline:
            with lock:
                request = requests[next(counter) % len(requests)]
                shapes.add(tuple(v.shape for v in request.values()))
            t0 = loadgen.clock()
            out = jitted(params, **request)
            jax.block_until_ready(out)
            with lock:
                latencies.append(loadgen.clock() - t0)

    t0 = loadgen.clock()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker) for _ in range(threads)]:
            f.result()
    elapsed = loadgen.clock() - t0
    return loadgen.run_result(
        "jit",
        f"jax.jit per request shape, {threads} threads (compiles on the request path)",
        latencies,
        1,
        elapsed,
        concurrency=threads,
        shapes_compiled=len(shapes),
    )


def bench(
    model: pxrt.Model,
    padded: pxrt.Model | None,
    *,
    lengths: str,
    concurrency: int,
    duration: float,
    options: dict,
    repeats: int = 2,
    fn: Any = None,
    jit_threads: int = 4,
    out_dir: str | None = None,
) -> dict:
    """Every run, alternated; the table and the ratios. ``padded``: the same artifact
    loaded at the longest length only (None: skip); ``fn``: the exported function for
    the ``jit`` baseline (None: skip)."""
    top = min(max(v) for v in model.dim_buckets.values())
    draw = parse_lengths(lengths, top)
    drawn = draw(2048, 0)
    requests = make_requests(model, drawn, 1, seed=10)
    results: list[dict] = []
    loop = new_event_loop()
    grid = options | {"cell_policy": "cost"}
    oldest = options | {"cell_policy": "oldest"}
    try:
        for _ in range(repeats):
            for m, opts, mode, label in [
                (model, grid, "grid", "pxrt grid, cost-based cells"),
                (model, oldest, "oldest", "pxrt grid, oldest first"),
            ] + ([(padded, grid, "padded", f"pxrt, all padded to {top}")] if padded else []):
                label = f"{label}: {concurrency} callers"
                results.append(
                    loop.run_until_complete(
                        _closed(m, opts, requests, concurrency, duration, mode, label)
                    )
                )
        saturated = max(r["requests_per_s"] for r in results if r["mode"] == "grid")
        rate = saturated / 2
        for _ in range(repeats):
            for opts, mode in ((grid, "grid-open"), (oldest, "oldest-open")):
                label = f"{mode[:-5]}: Poisson at {rate:,.0f} req/s"
                results.append(
                    loop.run_until_complete(
                        _open(model, opts, requests, rate, duration, mode, label)
                    )
                )
    finally:
        loop.close()
    if fn is not None:
        results.append(run_jit(model, fn, requests, jit_threads, duration))

    def med(mode: str, key: str) -> float:
        values = [r[key] for r in results if r["mode"] == mode]
        return float(np.median(values)) if values else float("nan")

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    grid_rate = med("grid", "requests_per_s")
    summary = {
        "grid_vs_padded_throughput": ratio(grid_rate, med("padded", "requests_per_s")),
        "grid_vs_oldest_throughput": ratio(grid_rate, med("oldest", "requests_per_s")),
        "oldest_vs_grid_p99_at_half_rate": ratio(
            med("oldest-open", "p99_ms"), med("grid-open", "p99_ms")
        ),
        "grid_vs_jit_throughput": ratio(grid_rate, med("jit", "requests_per_s")),
    }
    out = {
        "model": model.name,
        "devices": len(model.devices),
        "cells": [[s, c] for s, c in model.cells],
        "lengths": lengths,
        **_stats(drawn),
        "options": options,
        "results": results,
        "summary": summary,
    }
    print(
        f"\nmodel {model.name!r} on {len(model.devices)} device(s), {len(model.cells)} cells "
        f"{model.dim_buckets}, lengths {lengths} (median {out['median_length']:g}, max "
        f"{out['max_length']}), {duration:g} s per run"
    )
    report.print_table(results)
    print()
    for key, value in summary.items():
        print(f"  {key.replace('_', ' ')}: {value:.2f}x")
    report.write_report(out, results, out_dir)
    return out
