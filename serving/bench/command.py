"""The ``pxrt bench`` command line: argument parsing, then an in-process or HTTP run."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile


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
        default=0,
        help="the most rows in a batch (pxrt and the plain batcher); 0: the largest bucket",
    )
    p.add_argument(
        "--max-delay-us", type=float, default=0.0, help="pxrt's extra wait for fuller batches"
    )
    p.add_argument("--max-inflight", type=int, default=2)
    p.add_argument("--out", default="bench-results", help="folder for bench.json and bench.png")
    p.add_argument("--quick", action="store_true", help="a short run (as `make demo` does)")
    p.add_argument("--url", help="drive a running KServe v2 server over HTTP instead")
    p.add_argument("--model", default="mlp", help="the model to drive, with --url")
    p.add_argument("--json", action="store_true", help="JSON tensors over HTTP, not binary")
    p.add_argument(
        "--lengths",
        default="pareto:8:256",
        help="models with named dimensions: request lengths, pareto:LOW:HIGH (long-tailed), "
        "uniform:LOW:HIGH or fixed:N; these run grid vs oldest-first vs padded vs jit per "
        "shape at 64 callers, then Poisson arrivals at half the saturated rate",
    )
    p.add_argument("--width", type=int, default=None, help="demo model width (no model_dir)")
    p.add_argument("--layers", type=int, default=None, help="demo model depth (no model_dir)")


def main(args: argparse.Namespace) -> int:
    import pxrt
    from pxrt import demo

    if args.quick:
        args.duration = min(args.duration, 1.0)
        args.concurrency = "1,64,256"
    if args.url:
        try:
            from .http import bench_url
        except ImportError as exc:
            raise SystemExit(
                f"pxrt bench --url needs aiohttp ({exc}): pip install 'pxrt[bench]'"
            ) from None

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
        if model.dim_names:
            return _bench_lengths(args, path, model)
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
        from .inprocess import bench

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


def _bench_lengths(args: argparse.Namespace, path: str, model) -> int:
    import pxrt

    from . import lengths

    try:
        lengths.parse_lengths(args.lengths, 1)  # a bad spec fails before the second load
    except ValueError as exc:
        print(f"pxrt bench: error: {exc}", file=sys.stderr)
        return 2
    longest = {d: (max(v),) for d, v in model.dim_buckets.items()}
    padded = pxrt.load(path, dim_buckets=longest, progress=True)
    gc.collect()
    gc.freeze()
    lengths.bench(
        model,
        padded,
        lengths=args.lengths,
        concurrency=64,
        duration=args.duration,
        options={
            "max_batch_size": args.max_batch_size or None,
            "max_delay_us": args.max_delay_us,
            "max_queue": 1 << 20,
            "max_inflight": args.max_inflight,
        },
        repeats=1 if args.quick else 2,
        fn=lengths.exported_fn(model),
        out_dir=args.out,
    )
    return 0
