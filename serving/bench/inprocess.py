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

from ..engine.server import Server, new_event_loop
from . import baselines, loadgen, report
from .schedule import Schedule, plans


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
    model: pxrt.Model, options: dict, plan: Schedule, rows: int, duration: float
) -> tuple[dict, loadgen.Records]:
    """pxrt under ``plan``'s arrivals (latency from each scheduled arrival): the run's
    row and its per-request records."""
    times = plan.times(duration, seed=4)
    sizes = plan.rows[: len(times)] if plan.rows else None
    if sizes is None:
        request: Any = pxrt.example_inputs(model.inputs, rows, seed=3)
    else:  # a trace's own sizes, in order
        request = [pxrt.example_inputs(model.inputs, n, seed=3) for n in sizes]
    (records, elapsed), stats = await _on_server(
        model,
        options,
        lambda server: loadgen.scheduled_run(
            functools.partial(server.submit, "bench"),
            request,
            times,
            rows=sizes if sizes is not None else rows,
        ),
    )
    span = max(float(times[-1]) if len(times) else 0.0, 1e-9)
    result = loadgen.run_result(
        "pxrt-open",
        f"pxrt: {plan.label}",
        records.latencies(),
        rows,
        max(elapsed, span),
        offered_per_s=len(times) / span,
        errors=len(records.errors),
        late_share=records.late_share(),
        **stats,
    )
    return result, records


def bench(
    model: pxrt.Model,
    *,
    concurrency: list[int],
    naive_concurrency: list[int],
    rows: int,
    duration: float,
    options: dict,
    out_dir: str | None,
    arrival: str = "poisson",
    rates: list[float] | None = None,
    csv_path: str | None = None,
    records_path: str | None = None,
    stability: tuple[float, int] | None = None,
    goodput_ms: float | None = None,
) -> dict:
    """Every run, the table, the summary, and the report files. The open-loop runs
    follow ``arrival``'s shape (``serving.bench.schedule``) at each of ``rates``
    (default: half the saturated rate). ``stability`` (threshold, max windows): pxrt's
    closed-loop runs are measured until stable; ``goodput_ms``: then the highest rate
    whose p99 stays within it."""
    from . import method

    plans(arrival, rates, 1.0)  # a bad spec fails before any run
    steps = 1 + 2 * len(concurrency) + len(rates or [None]) + len(naive_concurrency)
    steps += 1 if goodput_ms else 0
    results: list[dict] = []
    recorded: list[tuple[str, loadgen.Records]] = []
    search: dict[str, Any] | None = None
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
                    if kind == "pxrt" and stability is not None:

                        def window(c: int = c) -> dict:
                            return loop.run_until_complete(
                                run_closed(model, options, c, rows, duration)
                            )

                        windows, ok = method.stable(
                            window, threshold=stability[0], max_windows=stability[1]
                        )
                        results.append(loadgen.merge_windows(windows) | {"stable": ok})
                    else:
                        results.append(
                            loop.run_until_complete(fn(model, options, c, rows, duration))
                        )
                    bar.update()
            saturated = max(
                (r["requests_per_s"] for r in results if r["mode"] == "pxrt-closed"), default=0.0
            )
            for plan in plans(arrival, rates, saturated / 2 or 100.0):
                bar.set_postfix_str(plan.label)
                result, records = loop.run_until_complete(
                    run_open(model, options, plan, rows, duration)
                )
                results.append(result)
                recorded.append((result["label"], records))
                bar.update()
            if goodput_ms:
                bar.set_postfix_str(f"goodput under p99 {goodput_ms:g} ms")
                shape = plans(arrival, None, 1.0)[0]
                if shape.kind == "trace":
                    shape = Schedule("poisson", 1.0)

                def probe(rate: float) -> float:
                    row, _ = loop.run_until_complete(
                        run_open(model, options, shape.at(rate), rows, duration)
                    )
                    return row["p99_ms"] if not row["errors"] else float("inf")

                high = 1.5 * (saturated or 1000.0)
                best, probed = method.goodput(probe, goodput_ms, high / 64, high)
                search = {
                    "objective_ms": goodput_ms,
                    "goodput_per_s": best,
                    "at_least": best >= high,
                    "probes": [{"rate": r, "p99_ms": v} for r, v in probed],
                }
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
    if search is not None:
        out["goodput"] = search
    report.print_table(results)
    for r in results:
        if r.get("stable") is False:
            print(f"unstable: {r['label']} (the last 3 of {r['windows']} windows disagree)")
        if r.get("late_share", 0) > 0.05:
            print(
                f"warning: {r['late_share']:.0%} of {r['label']} were sent over 2 ms late: "
                "the load generator could not keep up, so this rate was not offered"
            )
    if search is not None:
        print(
            f"goodput: {'at least ' if search['at_least'] else ''}"
            f"{search['goodput_per_s']:,.0f} req/s keep p99 within {goodput_ms:g} ms "
            f"({len(search['probes'])} probes)"
        )
    print()
    report.print_summary(summary)
    report.write_report(out, results, out_dir)
    if csv_path:  # pxrt's own runs (the baselines are in bench.json)
        report.write_csv(
            csv_path, [r for r in results if r["mode"] in ("pxrt-closed", "pxrt-open")]
        )
        print(f"wrote {csv_path}")
    if records_path:
        report.write_records(records_path, recorded)
        print(f"wrote {records_path}")
    out["hung"] = any(r.get("hung_threads") for r in results)
    return out


def compare(
    models: tuple[pxrt.Model, pxrt.Model],
    labels: tuple[str, str],
    *,
    concurrency: list[int],
    rows: int,
    duration: float,
    options: dict,
    repeats: int,
    out_dir: str | None,
) -> dict:
    """Two models (two artifacts, or one loaded two ways) on fresh servers at each
    concurrency, alternated ``repeats`` times, as ratios B / A with intervals
    (``serving.bench.method``)."""
    from . import method

    rows_out: list[dict] = []
    loop = new_event_loop()
    try:
        with tqdm(total=len(concurrency) * repeats * 2, desc="pxrt bench --compare",
                  unit="run", leave=False) as bar:  # fmt: skip
            for c in concurrency:
                runs: list[list[dict]] = [[], []]
                for rep in range(repeats):
                    for i in (0, 1) if rep % 2 == 0 else (1, 0):
                        runs[i].append(
                            loop.run_until_complete(
                                run_closed(models[i], options, c, rows, duration)
                            )
                        )
                        bar.update()
                rows_out.append(method.compare_row(c, runs[0], runs[1]))
    finally:
        loop.close()
    out = {"models": list(labels), "repeats": repeats, "options": options, "compare": rows_out}
    method.print_compare(labels, repeats, rows_out)
    report.write_compare(out, out_dir)
    return out
