"""``pxrt bench`` in one process: pxrt's ``Server`` against the ceiling, a plain asyncio
batcher and the naive way, on the same model, loop and machine.

At each concurrency of the closed-loop sweep, pxrt and the plain batcher run in turn
(same callers, same buckets, same ``max_batch_size``); then pxrt under open-loop Poisson
arrivals at half its best rate; the naive thread pool last (if jax deadlocks under its
threads, nothing else is lost).
"""

from __future__ import annotations

import functools
from typing import Any

from tqdm.auto import tqdm

import pxrt

from ..server import Server, new_event_loop
from . import baselines, loadgen, report


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


async def _on_server(model: pxrt.Model, options: dict, drive: Any) -> tuple[Any, dict]:
    """``await drive(server)`` on a fresh Server serving ``model`` as "bench"; returns its
    result and the server-side figures of the run (batches, stages, loop lag)."""
    async with Server() as server:
        server.add_model("bench", model, **options)
        async with loadgen.LagMonitor() as lag:
            out = await drive(server)
        snap = server.metrics_snapshot()["bench"]
    return out, _server_stats(snap) | {"loop_lag_p99_ms": lag.p99_ms}


async def run_closed(
    model: pxrt.Model, options: dict, concurrency: int, rows: int, duration: float
) -> dict:
    """pxrt: ``concurrency`` callers awaiting ``Server.infer`` on a fresh server."""
    request = pxrt.example_inputs(model.inputs, rows, seed=2)
    (latencies, elapsed, _), stats = await _on_server(
        model,
        options,
        lambda server: loadgen.closed_loop(
            functools.partial(server.infer, "bench"), request, concurrency, duration
        ),
    )
    return loadgen.run_result(
        "pxrt-closed",
        f"pxrt: {concurrency} concurrent callers",
        latencies,
        rows,
        elapsed,
        concurrency=concurrency,
        **stats,
    )


async def run_plain(
    model: pxrt.Model, options: dict, concurrency: int, rows: int, duration: float
) -> dict:
    """The plain asyncio batcher, same callers and batch size."""
    request = pxrt.example_inputs(model.inputs, rows, seed=2)
    plain = baselines.PlainBatcher(
        model, options.get("max_batch_size"), options.get("max_inflight", 2)
    )
    try:
        latencies, elapsed, _ = await loadgen.closed_loop(
            plain.infer, request, concurrency, duration
        )
    finally:
        plain.close()
    return loadgen.run_result(
        "plain",
        f"plain asyncio batcher: {concurrency} callers",
        latencies,
        rows,
        elapsed,
        concurrency=concurrency,
    )


async def run_open(
    model: pxrt.Model, options: dict, rate: float, rows: int, duration: float
) -> dict:
    """pxrt under Poisson arrivals at ``rate``, latency from each scheduled arrival."""
    request = pxrt.example_inputs(model.inputs, rows, seed=3)
    (latencies, errors), stats = await _on_server(
        model,
        options,
        lambda server: loadgen.open_loop(
            functools.partial(server.submit, "bench"), request, rate, duration
        ),
    )
    return loadgen.run_result(
        "pxrt-open",
        f"pxrt: Poisson arrivals at {rate:,.0f} req/s",
        latencies,
        rows,
        duration,
        offered_per_s=rate,
        errors=errors,
        **stats,
    )


def bench(
    model: pxrt.Model,
    *,
    concurrency: list[int],
    naive_concurrency: list[int],
    rows: int,
    duration: float,
    options: dict,
    out_dir: str | None,
) -> dict:
    """Every run, the table, the summary, and the report files."""
    steps = 1 + 2 * len(concurrency) + 1 + len(naive_concurrency)
    results: list[dict] = []
    with tqdm(total=steps, desc="pxrt bench", unit="run", leave=False) as bar:
        bar.set_postfix_str("ceiling")
        results.append(
            baselines.run_ceiling(model, duration, options.get("max_batch_size") or None)
        )
        bar.update()
        loop = new_event_loop()
        try:
            for c in concurrency:
                for kind, fn in (("pxrt", run_closed), ("plain", run_plain)):
                    bar.set_postfix_str(f"{kind} x{c}")
                    results.append(loop.run_until_complete(fn(model, options, c, rows, duration)))
                    bar.update()
            saturated = max(r["requests_per_s"] for r in results if r["mode"] == "pxrt-closed")
            bar.set_postfix_str("open loop")
            results.append(
                loop.run_until_complete(run_open(model, options, saturated / 2, rows, duration))
            )
            bar.update()
        finally:
            loop.close()
        for c in naive_concurrency:
            bar.set_postfix_str(f"naive x{c}")
            results.append(baselines.run_naive(model, c, rows, duration))
            bar.update()

    summary = report.summarize(results, options.get("max_delay_us", 0.0))
    out: dict[str, Any] = {
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
    report.print_table(results)
    print()
    report.print_summary(summary)
    report.write_report(out, results, out_dir)
    out["hung"] = any(r.get("hung_threads") for r in results)
    return out
