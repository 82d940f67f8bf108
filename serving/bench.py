"""``pxrt bench``: an in-process load generator over the async serving API.

One run measures, side by side on the same model and machine:

- the ceiling: the largest bucket executed back to back on prepared staging;
- the naive way: one ``Compiled.__call__`` per request from a thread pool;
- pxrt, closed loop: a concurrency sweep of callers awaiting ``Server.infer``;
- pxrt, open loop: Poisson arrivals at half the saturated rate (latency measured from
  each request's scheduled arrival, so a slow server cannot hide its queueing);
- event-loop lag while saturated.

It prints a table, writes ``bench.json`` and ``bench.png`` (latency percentiles against
throughput, and latency CDFs) into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

PERCENTILES = (50, 90, 99, 99.9)


def _latency_stats(lat_s: list[float]) -> dict:
    if not lat_s:
        return {f"p{p}_ms": float("nan") for p in PERCENTILES}
    arr = np.asarray(lat_s) * 1e3
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
        **_latency_stats(latencies),
        **extra,
        "latencies_ms": _sample(latencies),
    }


def _p99_ms(samples: list[float]) -> float:
    return float(np.percentile(samples, 99) * 1e3) if samples else float("nan")


def _request(model: Any, rows: int, seed: int) -> dict:
    import pxrt

    return pxrt.example_inputs(model.inputs, rows, seed=seed)


# --------------------------------------------------------------------------- baselines


def run_ceiling(model: Any, duration: float, max_batch_size: int | None) -> dict:
    """The largest bucket the server will use (the one ``max_batch_size`` rows run in)
    back to back on a prepared staging slot."""
    bucket = model.bucket(model.bucket_for(min(max_batch_size or model.max_batch, model.max_batch)))
    slot = bucket.ring.acquire()
    try:
        for buf, value in zip(slot.buffers, _request(model, bucket.size, 0).values()):
            buf[...] = value
        program = bucket.program
        program.run(slot)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration:
            program.run(slot)
            n += 1
        elapsed = time.perf_counter() - t0
    finally:
        bucket.ring.release(slot)
    return {
        "mode": "ceiling",
        "label": f"ceiling: bucket {bucket.size} back to back",
        "rows_per_s": n * bucket.size / elapsed,
        "requests_per_s": float("nan"),
        "exec_ms": elapsed / n * 1e3,
    }


def run_naive(model: Any, concurrency: int, rows: int, duration: float) -> dict:
    """One Compiled.__call__ per request (padded to the smallest bucket that holds it),
    from ``concurrency`` threads, closed loop."""
    import jax

    size = model.bucket_for(rows)
    compiled, params = model.bucket(size).compiled, model.params_dev
    x64 = model.artifact.x64
    request = _request(model, rows, 1)
    padded = [
        np.concatenate([v, np.zeros((size - rows,) + v.shape[1:], v.dtype)])
        for v in request.values()
    ]
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + duration

    def worker() -> None:
        mine = []
        with jax.enable_x64(x64):
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                outs = compiled(params, *padded)
                [np.asarray(o)[:rows] for o in outs]
                mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    # Daemon threads and a watchdog, not a pool: on several CPU devices, jax 0.10.2's
    # Compiled.__call__ from 64 threads has deadlocked here (wide models); the bench
    # reports that instead of hanging with it.
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, stop + 30 - time.perf_counter()))
    elapsed = time.perf_counter() - t0
    hung = sum(t.is_alive() for t in threads)
    label = f"naive: Compiled.__call__ per request, {concurrency} threads"
    if hung:
        label = f"naive: {hung} of {concurrency} threads HUNG in jax"
    return run_result(
        "naive", label, latencies, rows, elapsed, concurrency=concurrency, hung_threads=hung
    )


# --------------------------------------------------------------------------- pxrt


async def _lag_monitor(stop: asyncio.Event, lags: list[float], period: float = 1e-3) -> None:
    """Every ``period``, time one trip around the loop (``sleep(0)``): how long anything
    that becomes ready now waits for the loop. Timer granularity (1 ms in uvloop) does
    not enter it."""
    clock = time.perf_counter
    while not stop.is_set():
        await asyncio.sleep(period)
        t0 = clock()
        await asyncio.sleep(0)
        lags.append(clock() - t0)


async def poisson_arrivals(rate: float, duration: float, seed: int):
    """Yield scheduled arrival times (perf_counter) of a Poisson process for ``duration``
    seconds, sleeping until each. A late loop yields the missed arrivals at once: latency
    measured from the scheduled time then includes the lateness, as it should."""
    rng = np.random.default_rng(seed)
    clock = time.perf_counter  # not loop.time(): on uvloop it moves in whole ms
    start = at = clock()
    while at - start < duration:
        at += rng.exponential(1.0 / rate)
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        yield at


async def _with_server(model: Any, options: dict, body: Any) -> tuple[Any, dict, list[float]]:
    """Run ``body(server)`` on a fresh Server serving ``model`` as "bench"; returns its
    result, the server's metrics snapshot and the event-loop lags seen meanwhile."""
    from .server import Server

    lags: list[float] = []
    stop = asyncio.Event()
    async with Server() as server:
        server.add_model("bench", model, **options)
        monitor = asyncio.ensure_future(_lag_monitor(stop, lags))
        try:
            result = await body(server)
        finally:
            stop.set()
            await monitor
        snapshot = server.metrics_snapshot()["bench"]
    return result, snapshot, lags


async def run_closed(
    model: Any, options: dict, concurrency: int, rows: int, duration: float
) -> dict:
    request = _request(model, rows, 2)

    async def body(server: Any) -> tuple[list[float], float]:
        latencies: list[float] = []
        clock = time.perf_counter
        deadline = clock() + duration

        async def caller() -> None:
            while clock() < deadline:
                t0 = clock()
                await server.infer("bench", request)
                latencies.append(clock() - t0)

        t0 = clock()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = clock() - t0
        return latencies, elapsed

    (latencies, elapsed), snap, lags = await _with_server(model, options, body)
    return run_result(
        "pxrt-closed",
        f"pxrt: {concurrency} concurrent callers",
        latencies,
        rows,
        elapsed,
        concurrency=concurrency,
        loop_lag_p99_ms=_p99_ms(lags),
        **_server_stats(snap),
    )


async def run_open(model: Any, options: dict, rate: float, rows: int, duration: float) -> dict:
    request = _request(model, rows, 3)

    async def body(server: Any) -> tuple[list[float], int]:
        clock = time.perf_counter
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

        # One future per request, no task: the generator itself must cost the loop
        # little, or it, not the server, sets the rate it can offer.
        async for at in poisson_arrivals(rate, duration, seed=4):
            outstanding += 1
            server.submit("bench", request).add_done_callback(functools.partial(done, scheduled=at))
        generating = False
        if outstanding:
            await all_done.wait()
        return latencies, errors

    (latencies, errors), snap, lags = await _with_server(model, options, body)
    return run_result(
        "pxrt-open",
        f"pxrt: Poisson arrivals at {rate:,.0f} req/s",
        latencies,
        rows,
        duration,
        offered_per_s=rate,
        errors=errors,
        loop_lag_p99_ms=_p99_ms(lags),
        **_server_stats(snap),
    )


def _server_stats(snap: dict) -> dict:
    return {
        "batch_rows": snap["batch_rows"]["mean"],
        "padding": snap["padding_ratio"]["mean"],
        "batches": snap.get("batches", 0),
        "stages_us": {
            k: snap[f"{k}_us"]["mean"]
            for k in ("queue", "compute_input", "compute_infer", "compute_output")
        },
    }


def _sample(latencies_s: list[float], n: int = 4000) -> list[float]:
    """Up to n latencies in ms (evenly strided), enough for a CDF plot."""
    arr = np.sort(np.asarray(latencies_s)) * 1e3
    if len(arr) > n:
        arr = arr[np.linspace(0, len(arr) - 1, n).astype(int)]
    return [round(float(v), 4) for v in arr]


# --------------------------------------------------------------------------- report


def _fmt(v: Any, digits: int = 2) -> str:
    if isinstance(v, float):
        return "-" if np.isnan(v) else f"{v:,.{digits}f}"
    return str(v)


def print_table(results: list[dict]) -> None:
    head = (
        f"{'run':<44} {'req/s':>10} {'rows/s':>10} {'p50 ms':>7} {'p90':>7} {'p99':>7} "
        f"{'p99.9':>7} {'rows/b':>6} {'pad':>5}  queue/in/infer/out us"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        stages = r.get("stages_us")
        stage_txt = "/".join(f"{v:.0f}" for v in stages.values()) if stages else ""
        print(
            f"{r['label']:<44} {_fmt(r.get('requests_per_s', float('nan')), 0):>10} "
            f"{_fmt(r['rows_per_s'], 0):>10} {_fmt(r.get('p50_ms', float('nan'))):>7} "
            f"{_fmt(r.get('p90_ms', float('nan'))):>7} {_fmt(r.get('p99_ms', float('nan'))):>7} "
            f"{_fmt(r.get('p99.9_ms', float('nan'))):>7} "
            f"{_fmt(r.get('batch_rows', float('nan')), 1):>6} "
            f"{_fmt(r.get('padding', float('nan'))):>5}  {stage_txt}"
        )


def summarize(results: list[dict], options: dict) -> dict:
    ceiling = next(r for r in results if r["mode"] == "ceiling")
    closed = [r for r in results if r["mode"] == "pxrt-closed"]
    saturated = max(closed, key=lambda r: r["rows_per_s"])
    summary: dict[str, Any] = {
        "saturated_rows_per_s": saturated["rows_per_s"],
        "saturated_vs_ceiling": saturated["rows_per_s"] / ceiling["rows_per_s"],
        "loop_lag_p99_ms_saturated": saturated["loop_lag_p99_ms"],
    }
    for naive in (r for r in results if r["mode"] == "naive"):
        same = [r for r in closed if r["concurrency"] == naive["concurrency"]]
        if same and naive["requests_per_s"] > 0:
            summary[f"pxrt_vs_naive_at_{naive['concurrency']}"] = (
                same[0]["requests_per_s"] / naive["requests_per_s"]
            )
    opened = [r for r in results if r["mode"] == "pxrt-open"]
    if opened:
        bound = options["max_delay_us"] / 1e3 + 2 * ceiling["exec_ms"]
        summary["open_p99_ms"] = opened[0]["p99_ms"]
        summary["open_p99_bound_ms"] = bound
        summary["open_p99_vs_bound"] = opened[0]["p99_ms"] / bound
    return summary


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, marker in (("pxrt-closed", "o"), ("http-closed", "^"), ("naive", "s")):
        # In order of offered load (callers), so the curve reads left to right as it rises.
        runs = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["concurrency"])
        if not runs:
            continue
        x = [r["rows_per_s"] for r in runs]
        for p, style in (("p50", "-"), ("p99", "--")):
            ax1.plot(x, [r[f"{p}_ms"] for r in runs], style, marker=marker, label=f"{mode} {p}")
        for r in runs:
            ax1.annotate(
                f"x{r['concurrency']}",
                (r["rows_per_s"], r["p99_ms"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(3, 4),
            )
    for r in results:
        if r["mode"] in ("pxrt-open", "http-open"):
            ax1.plot([r["rows_per_s"]], [r["p99_ms"]], "r*", markersize=12, label="open-loop p99")
        if r["mode"] == "ceiling":
            ax1.axvline(r["rows_per_s"], color="grey", linestyle=":", label="ceiling")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("throughput (rows/s)")
    ax1.set_ylabel("latency (ms)")
    ax1.set_title("latency percentiles against throughput")
    ax1.legend(fontsize=7)
    for r in results:
        lat = r.get("latencies_ms")
        if lat:
            ax2.plot(lat, np.linspace(0, 1, len(lat)), label=r["label"][:40])
    ax2.set_xscale("log")
    ax2.set_xlabel("latency (ms)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("latency CDF")
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def bench(
    model: Any,
    *,
    concurrency: list[int],
    naive_concurrency: list[int],
    rows: int,
    duration: float,
    options: dict,
    out_dir: str | None,
) -> dict:
    from .server import new_event_loop

    steps = 1 + len(naive_concurrency) + len(concurrency) + 1
    results: list[dict] = []
    with tqdm(total=steps, desc="pxrt bench", unit="run", leave=False) as bar:
        bar.set_postfix_str("ceiling")
        results.append(run_ceiling(model, duration, options.get("max_batch_size")))
        bar.update()
        loop = new_event_loop()
        try:
            for c in concurrency:
                bar.set_postfix_str(f"pxrt x{c}")
                results.append(
                    loop.run_until_complete(run_closed(model, options, c, rows, duration))
                )
                bar.update()
            saturated = max(r["requests_per_s"] for r in results if r["mode"] == "pxrt-closed")
            bar.set_postfix_str("open loop")
            results.append(
                loop.run_until_complete(run_open(model, options, saturated / 2, rows, duration))
            )
            bar.update()
        finally:
            loop.close()
        # Last: if jax deadlocks under the naive way's threads, nothing else is lost.
        for c in naive_concurrency:
            bar.set_postfix_str(f"naive x{c}")
            results.append(run_naive(model, c, rows, duration))
            bar.update()

    summary = summarize(results, options)
    report = {
        "model": model.name,
        "devices": len(model.devices),
        "buckets": list(model.buckets),
        "rows_per_request": rows,
        "duration_s": duration,
        "options": options,
        "results": results,
        "summary": summary,
    }
    print(
        f"\nmodel {model.name!r} on {len(model.devices)} device(s), buckets {model.buckets}, "
        f"{rows}-row requests, {duration:g} s per run, options {options}"
    )
    print_table(results)
    print()
    print(f"saturated throughput / ceiling:      {summary['saturated_vs_ceiling']:.2f}x")
    for k, v in summary.items():
        if k.startswith("pxrt_vs_naive"):
            print(f"pxrt / naive at {k.rsplit('_', 1)[1]} callers:        {v:.1f}x")
    if "open_p99_ms" in summary:
        print(
            f"open-loop p99 at half the saturated rate: {summary['open_p99_ms']:.2f} ms "
            f"(bound max_delay + 2 x largest-bucket exec: {summary['open_p99_bound_ms']:.2f} "
            f"ms, {summary['open_p99_vs_bound']:.2f}x of it)"
        )
    print(f"event-loop lag p99 while saturated:   {summary['loop_lag_p99_ms_saturated']:.2f} ms")
    write_report(report, results, out_dir)
    report["hung"] = any(r.get("hung_threads") for r in results)
    return report


def write_report(report: dict, results: list[dict], out_dir: str | None) -> None:
    """bench.json and bench.png into ``out_dir``."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(report, f, indent=1)
        plot(results, os.path.join(out_dir, "bench.png"))
        print(f"wrote {out_dir}/bench.json and {out_dir}/bench.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="artifact directory (default: the demo model)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    p.add_argument(
        "--concurrency", default="1,16,64,256,1024", help="closed-loop callers, comma-separated"
    )
    p.add_argument(
        "--naive-concurrency",
        default="64",
        help="threads for the naive baseline, comma-separated (empty: skip)",
    )
    p.add_argument("--rows", type=int, default=1, help="rows per request")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=64,
        help="rows that close a batch at once; 0: the largest bucket",
    )
    p.add_argument("--max-delay-us", type=float, default=2000.0)
    p.add_argument("--max-inflight", type=int, default=2)
    p.add_argument("--out", default="bench-results", help="folder for bench.json and bench.png")
    p.add_argument("--quick", action="store_true", help="a short run (as `make demo` does)")
    p.add_argument("--url", help="drive a running KServe v2 server over HTTP instead")
    p.add_argument("--model", default="mlp", help="the model to drive, with --url")
    p.add_argument("--json", action="store_true", help="JSON tensors over HTTP, not binary")
    p.add_argument("--width", type=int, default=None, help="demo model width (no model_dir)")
    p.add_argument("--layers", type=int, default=None, help="demo model depth (no model_dir)")


def main(args: argparse.Namespace) -> int:
    import pxrt
    from pxrt import demo

    if args.quick:
        args.duration = min(args.duration, 1.0)
        args.concurrency = "1,64,256"
    if args.url:
        from .bench_http import bench_url

        bench_url(
            args.url,
            args.model,
            rows=args.rows,
            duration=args.duration,
            concurrency=[int(c) for c in args.concurrency.split(",") if c],
            binary=not args.json,
            out_dir=args.out,
        )
        return 0

    with tempfile.TemporaryDirectory(prefix="pxrt-bench-") as tmp:
        path = args.model_dir
        if path is None:
            path = os.path.join(tmp, "mlp")
            demo.export_demo(
                path, width=args.width or demo.WIDTH, layers=args.layers or demo.LAYERS
            )
        model = pxrt.load(path, progress=True)
        # Everything alive now (jax's many objects included) leaves the collector's
        # view: its full passes otherwise stall the loop for tens of ms (p99 x10 here).
        gc.collect()
        gc.freeze()
        options = {
            "max_batch_size": args.max_batch_size or None,
            "max_delay_us": args.max_delay_us,
            "max_queue": 1 << 20,
            "max_inflight": args.max_inflight,
        }
        report = bench(
            model,
            concurrency=[int(c) for c in args.concurrency.split(",") if c],
            naive_concurrency=[int(c) for c in args.naive_concurrency.split(",") if c],
            rows=args.rows,
            duration=args.duration,
            options=options,
            out_dir=args.out,
        )
    if report["hung"]:
        # Threads stuck inside jax would block the interpreter's exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
