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
    load = p.add_argument_group("open loop, stability, goodput, output")
    load.add_argument(
        "--request-rate",
        default="",
        help="open-loop rates (req/s), comma-separated (default: half the best closed-loop rate)",
    )
    load.add_argument(
        "--arrival",
        default="poisson",
        help="open-loop arrivals: poisson, constant, gamma::B (burstiness B: < 1 burstier, "
        "1 Poisson), ramp:FROM:TO (req/s over the run), trace:FILE (JSON lines with "
        "timestamp in ms and optional rows, or perf_analyzer's intervals file, in us)",
    )
    load.add_argument(
        "--stability",
        action="store_true",
        help="measure each closed-loop run in windows of --duration until the last 3 agree "
        "within --stability-threshold (as perf_analyzer does)",
    )
    load.add_argument("--stability-threshold", type=float, default=0.10)
    load.add_argument("--max-windows", type=int, default=10)
    load.add_argument(
        "--goodput-p99-ms",
        type=float,
        default=None,
        help="also search the highest rate whose p99 stays within this many ms",
    )
    load.add_argument(
        "--input-data",
        help="--url: send the requests of this file (perf_analyzer's JSON input format: "
        '{"data": [{INPUT: values | {"content": [...], "shape": [...]} | {"b64": ...}}]}), '
        "round robin",
    )
    load.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME:D1,D2",
        help="--url: the dims (without the batch) of an input with named (-1) dimensions, "
        "for the random requests (repeat for several inputs)",
    )
    load.add_argument("--csv", help="write the runs as perf_analyzer's CSV (latencies in us)")
    load.add_argument("--records", help="write every open-loop request as a JSON line")
    load.add_argument(
        "--compare",
        metavar="B",
        help="--url A --compare URL_B: both servers at each concurrency, alternated "
        "--repeats times, as ratios B/A with 95%% intervals; in process, B is a second "
        "artifact directory (A: model_dir, or the demo model)",
    )
    load.add_argument("--repeats", type=int, default=3, help="alternated repeats of --compare")
    load.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="--url: generate the load from this many processes (a Python client then "
        "is not what is measured); the client's CPU per request is in the report",
    )
    gen = p.add_argument_group("a decoder (--url, found by its metadata): generation")
    gen.add_argument("--prompt-tokens", default="pareto:4:64", help="prompt lengths (as --lengths)")
    gen.add_argument("--output-tokens", default="uniform:16:128", help="max_tokens of each request")
    gen.add_argument(
        "--goodput-metric",
        choices=("ttft", "itl", "tpot"),
        default="ttft",
        help="what --goodput-p99-ms bounds for a decoder (default: time to first token)",
    )
    p.add_argument("--width", type=int, default=None, help="demo model width (no model_dir)")
    p.add_argument("--layers", type=int, default=None, help="demo model depth (no model_dir)")


def main(args: argparse.Namespace) -> int:
    import pxrt
    from pxrt import demo

    from .schedule import plans

    if args.quick:
        args.duration = min(args.duration, 1.0)
        args.concurrency = "1,64,256"
    from .inputs import parse_shapes

    try:
        shapes = parse_shapes(args.shape)
        rates = [float(r) for r in args.request_rate.split(",") if r]
        if any(not r > 0 for r in rates):
            raise ValueError("--request-rate: rates must be > 0")
        plans(args.arrival, rates, 1.0)  # a bad spec fails before any run
    except ValueError as exc:
        print(f"pxrt bench: error: {exc}", file=sys.stderr)
        return 2
    if args.client_procs < 1:
        print("pxrt bench: error: --client-procs must be >= 1", file=sys.stderr)
        return 2
    if args.compare and not args.url and "://" in args.compare:
        print("pxrt bench: error: --compare URL_B needs --url URL_A", file=sys.stderr)
        return 2
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if args.url:
        try:
            from .http import bench_url, compare_urls
        except ImportError as exc:
            raise SystemExit(
                f"pxrt bench --url needs aiohttp ({exc}): pip install 'pxrt[bench]'"
            ) from None

        from .generate import bench_generate, is_decoder

        if is_decoder(args.url, args.model):
            try:
                bench_generate(
                    args.url,
                    args.model,
                    concurrency=concurrency,
                    duration=args.duration,
                    prompt_tokens=args.prompt_tokens,
                    output_tokens=args.output_tokens,
                    arrival=args.arrival,
                    rates=rates or None,
                    goodput_ms=args.goodput_p99_ms,
                    goodput_metric=args.goodput_metric,
                    records_path=args.records,
                    out_dir=args.out,
                )
            except ValueError as exc:
                print(f"pxrt bench: error: {exc}", file=sys.stderr)
                return 2
            return 0
        try:
            if args.compare:
                compare_urls(
                    (args.url, args.compare),
                    args.model,
                    concurrency=concurrency,
                    rows=args.rows,
                    duration=args.duration,
                    binary=not args.json,
                    repeats=args.repeats,
                    out_dir=args.out,
                    client_procs=args.client_procs,
                    shapes=shapes,
                    input_data=args.input_data,
                )
                return 0
            bench_url(
                args.url,
                args.model,
                rows=args.rows,
                duration=args.duration,
                concurrency=concurrency,
                binary=not args.json,
                out_dir=args.out,
                arrival=args.arrival,
                rates=rates or None,
                stability=(args.stability_threshold, args.max_windows) if args.stability else None,
                goodput_ms=args.goodput_p99_ms,
                csv_path=args.csv,
                records_path=args.records,
                client_procs=args.client_procs,
                shapes=shapes,
                input_data=args.input_data,
            )
        except ValueError as exc:  # the input data or the shapes: named in the message
            print(f"pxrt bench: error: {exc}", file=sys.stderr)
            return 2
        return 0

    with tempfile.TemporaryDirectory(prefix="pxrt-bench-") as tmp:
        path = args.model_dir
        if path is None:
            path = os.path.join(tmp, "mlp")
            demo.export_demo(
                path, width=args.width or demo.WIDTH, layers=args.layers or demo.LAYERS
            )
        model = pxrt.load(path, progress=True)
        if isinstance(model, pxrt.Decoder):
            from .generate import bench_local

            try:
                bench_local(
                    model,
                    concurrency=concurrency,
                    duration=args.duration,
                    prompt_tokens=args.prompt_tokens,
                    output_tokens=args.output_tokens,
                    arrival=args.arrival,
                    rates=rates or None,
                    out_dir=args.out,
                )
            except ValueError as exc:
                print(f"pxrt bench: error: {exc}", file=sys.stderr)
                return 2
            finally:
                model.close()
            return 0
        if args.compare:
            return _compare_in_process(args, model, path, concurrency)
        if model.dim_names:
            return _bench_lengths(args, path, model)
        # Everything alive now (jax's many objects included) leaves the collector's
        # view: its full passes otherwise stall the loop for tens of ms (p99 x10 here).
        gc.collect()
        gc.freeze()
        options = _serving_options(args)
        from .inprocess import bench

        report = bench(
            model,
            concurrency=concurrency,
            naive_concurrency=[int(c) for c in args.naive_concurrency.split(",") if c],
            rows=args.rows,
            duration=args.duration,
            options=options,
            out_dir=args.out,
            arrival=args.arrival,
            rates=rates or None,
            csv_path=args.csv,
            records_path=args.records,
            stability=(args.stability_threshold, args.max_windows) if args.stability else None,
            goodput_ms=args.goodput_p99_ms,
        )
    if report["hung"]:
        # Threads stuck inside jax would block the interpreter's exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _serving_options(args: argparse.Namespace) -> dict:
    """pxrt's batching options of an in-process run (its queue never the limit)."""
    return {
        "max_batch_size": args.max_batch_size or None,
        "max_delay_us": args.max_delay_us,
        "max_queue": 1 << 20,
        "max_inflight": args.max_inflight,
    }


def _compare_in_process(args: argparse.Namespace, model, path: str, concurrency: list) -> int:
    import pxrt

    from .inprocess import compare

    if not os.path.isdir(args.compare):
        print(f"pxrt bench: error: --compare {args.compare}: not a directory", file=sys.stderr)
        return 2
    other = pxrt.load(args.compare, progress=True)
    gc.collect()
    gc.freeze()
    compare(
        (model, other),
        (path if args.model_dir else "the demo model", args.compare),
        concurrency=concurrency,
        rows=args.rows,
        duration=args.duration,
        options=_serving_options(args),
        repeats=args.repeats,
        out_dir=args.out,
    )
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
        options=_serving_options(args),
        repeats=1 if args.quick else 2,
        fn=lengths.exported_fn(model),
        out_dir=args.out,
    )
    return 0
