"""The report of a bench run: the table, the summary ratios, bench.json and bench.png.

The plot needs matplotlib (``pip install 'pxrt[bench]'``); without it the JSON report
is still written and the table printed.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


def _fmt(v: Any, digits: int = 2) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:,.{digits}f}"
    return str(v)


def print_table(results: list[dict]) -> None:
    head = (
        f"{'run':<44} {'req/s':>10} {'rows/s':>10} {'p50 ms':>7} {'p90':>7} {'p99':>7} "
        f"{'p99.9':>7} {'rows/b':>6} {'pad':>5}  queue/in/infer/out us"
    )
    print(head)
    print("-" * len(head))
    nan = float("nan")
    for r in results:
        stages = r.get("stages_us")
        stage_txt = "/".join(f"{v:.0f}" for v in stages.values()) if stages else ""
        print(
            f"{r['label']:<44} {_fmt(r.get('requests_per_s', nan), 0):>10} "
            f"{_fmt(r['rows_per_s'], 0):>10} {_fmt(r.get('p50_ms', nan)):>7} "
            f"{_fmt(r.get('p90_ms', nan)):>7} {_fmt(r.get('p99_ms', nan)):>7} "
            f"{_fmt(r.get('p99.9_ms', nan)):>7} {_fmt(r.get('batch_rows', nan), 1):>6} "
            f"{_fmt(r.get('padding', nan)):>5}  {stage_txt}"
        )


def summarize(results: list[dict], max_delay_us: float) -> dict:
    """The ratios of an in-process run: pxrt against the ceiling, the plain batcher and
    the naive way, and the open-loop p99 against its bound."""
    ceiling = next(r for r in results if r["mode"] == "ceiling")
    closed = [r for r in results if r["mode"] == "pxrt-closed"]
    saturated = max(closed, key=lambda r: r["rows_per_s"])
    summary: dict[str, Any] = {
        "saturated_rows_per_s": saturated["rows_per_s"],
        "saturated_vs_ceiling": saturated["rows_per_s"] / ceiling["rows_per_s"],
        "loop_lag_p99_ms_saturated": saturated["loop_lag_p99_ms"],
    }
    for mode in ("plain", "naive"):
        for other in (r for r in results if r["mode"] == mode):
            same = [r for r in closed if r["concurrency"] == other["concurrency"]]
            if same and other["requests_per_s"] > 0:
                summary[f"pxrt_vs_{mode}_at_{other['concurrency']}"] = (
                    same[0]["requests_per_s"] / other["requests_per_s"]
                )
    opened = [r for r in results if r["mode"] == "pxrt-open"]
    if opened:
        bound = max_delay_us / 1e3 + 2 * ceiling["exec_ms"]
        summary["open_p99_ms"] = opened[0]["p99_ms"]
        summary["open_p99_bound_ms"] = bound
        summary["open_p99_vs_bound"] = opened[0]["p99_ms"] / bound
    return summary


def print_summary(summary: dict) -> None:
    print(f"saturated throughput / ceiling:      {summary['saturated_vs_ceiling']:.2f}x")
    for mode in ("plain", "naive"):
        for k, v in summary.items():
            if k.startswith(f"pxrt_vs_{mode}_at_"):
                callers = k.rsplit("_", 1)[1]
                print(f"pxrt / {mode} at {callers} callers:{'':<{14 - len(callers)}}{v:.2f}x")
    if "open_p99_ms" in summary:
        print(
            f"open-loop p99 at half the saturated rate: {summary['open_p99_ms']:.2f} ms "
            f"(bound max_delay + 2 x largest-bucket exec: {summary['open_p99_bound_ms']:.2f} "
            f"ms, {summary['open_p99_vs_bound']:.2f}x of it)"
        )
    print(f"event-loop lag p99 while saturated:   {summary['loop_lag_p99_ms_saturated']:.2f} ms")


def plot(results: list[dict], path: str) -> bool:
    """Latency against throughput and latency CDFs; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    modes: tuple[tuple[str, str], ...]
    modes = (("pxrt-closed", "o"), ("plain", "D"), ("http-closed", "^"), ("naive", "s"))
    modes += (("grpc-closed", "v"),)
    modes += (("grid", "o"), ("oldest", "D"), ("padded", "s"))  # variable-length runs
    for mode, marker in modes:
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
        if r["mode"] in ("pxrt-open", "http-open", "grpc-open", "grid-open", "oldest-open"):
            ax1.plot(
                [r["rows_per_s"]], [r["p99_ms"]], "r*", markersize=12, label=f"{r['mode']} p99"
            )
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
    return True


def write_report(report: dict, results: list[dict], out_dir: str | None) -> None:
    """bench.json and (with matplotlib) bench.png into ``out_dir``."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    if plot(results, os.path.join(out_dir, "bench.png")):
        print(f"wrote {out_dir}/bench.json and {out_dir}/bench.png")
    else:
        print(f"wrote {out_dir}/bench.json (no plot: pip install 'pxrt[bench]' for matplotlib)")


# perf_analyzer's CSV (``-f``): its columns, latencies and times in microseconds.
CSV_COLUMNS = (
    "Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
    "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
    "p50 latency", "p90 latency", "p95 latency", "p99 latency", "Avg latency",
)  # fmt: skip


def csv_rows(results: list[dict]) -> tuple[str, list[list[Any]]]:
    """The load column's name (``Concurrency`` or ``Request Rate``) and a row per run
    that has one, in perf_analyzer's columns. The client's send and receive times are
    not separated from the rest here: they are 0 and in ``Network+Server Send/Recv``
    (the mean latency less the server's stages, when the server reports them)."""
    runs = [r for r in results if "concurrency" in r or "offered_per_s" in r]
    rate_mode = any("offered_per_s" in r for r in runs) and not any(
        "concurrency" in r for r in runs
    )
    rows = []
    for r in runs:
        load = r.get("offered_per_s") if rate_mode else r.get("concurrency")
        if load is None:
            continue
        stages = r.get("stages_us") or {}
        mean_us = r["mean_ms"] * 1e3
        server: list[Any] = [""] * 4
        network: Any = ""
        if stages:
            server = [round(stages[k]) for k in ("queue", "compute_input", "compute_infer",
                                                 "compute_output")]  # fmt: skip
            network = round(mean_us - sum(stages.values()))
        rows.append(
            [
                round(load, 3),
                round(r["requests_per_s"], 3),
                0,
                network,
                *server,
                0,
                *(round(r[f"p{p}_ms"] * 1e3) for p in (50, 90, 95, 99)),
                round(mean_us),
            ]
        )
    return ("Request Rate" if rate_mode else "Concurrency"), rows


def write_csv(path: str, results: list[dict]) -> None:
    """``results`` as perf_analyzer's CSV (``csv_rows``)."""
    import csv

    load, rows = csv_rows(results)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([load, *CSV_COLUMNS])
        writer.writerows(rows)


def write_records(path: str, runs: list[tuple[str, Any]]) -> None:
    """Per-request records as JSON lines: one per request of each open-loop run
    (``runs``: (label, ``loadgen.Records``)), tagged with its run."""
    with open(path, "w") as f:
        for label, records in runs:
            for row in records.rows_of():
                f.write(json.dumps({"run": label, **row}) + "\n")


def write_compare(report: dict, out_dir: str | None) -> None:
    """compare.json into ``out_dir``."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "compare.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out_dir}/compare.json")
