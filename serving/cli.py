"""The ``pxrt`` command: ``pxrt demo | export SPEC DIR | inspect DIR | serve [DIR...] |
bench [DIR]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np


def _cmd_demo(args: argparse.Namespace) -> int:
    import jax

    import pxrt
    from pxrt import demo
    from pxrt.timing import compare, fmt_time

    with tempfile.TemporaryDirectory(prefix="pxrt-demo-") as tmp:
        path = args.keep or os.path.join(tmp, "mlp")
        demo.export_demo(path)
        print(f"exported the demo MLP ({demo.LAYERS} x {demo.WIDTH}, float32) to {path}")
        model = pxrt.load(path, progress=True)
        print(
            f"loaded {model}: {len(model.buckets)} buckets compiled in {model.load_s:.2f} s, "
            f"Cython handlers: {pxrt.using_extensions()}"
        )
        x = np.random.default_rng(0).standard_normal((5, demo.WIDTH)).astype(np.float32)
        y = model.run({"x": x})["y"]
        ref = np.asarray(jax.jit(demo.mlp)(demo.make_params(), x)["y"])
        print(
            f"run on 5 rows -> y{list(y.shape)}, max |pxrt - jax.jit| = "
            f"{float(np.abs(y - ref).max()):.2e}"
        )

        print(f"\nper call, median of interleaved rounds on {len(model.devices)} device(s):")
        print(f"{'bucket':>7}  {'Model.run':>11}  {'Compiled.__call__':>18}  {'ratio':>6}")
        for size in model.buckets:
            xb = np.random.default_rng(size).standard_normal((size, demo.WIDTH)).astype(np.float32)
            compiled = model.bucket(size).compiled
            request = {"x": xb}
            times = compare(
                {
                    "pxrt": lambda request=request: model.run(request),
                    "jax": lambda c=compiled, xb=xb: [
                        np.asarray(o) for o in c(model.params_dev, xb)
                    ],
                },
                rounds=args.rounds,
                calls=args.calls,
            )
            print(
                f"{size:>7}  {fmt_time(times['pxrt']):>11}  {fmt_time(times['jax']):>18}  "
                f"{times['pxrt'] / times['jax']:>5.2f}x"
            )
        print(f"\ncompiles after load: {model.compiles_after_load}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    import importlib

    import pxrt

    module_name, _, attr = args.spec.partition(":")
    if not attr:
        raise SystemExit("pxrt export: SPEC is MODULE:FUNCTION, e.g. pxrt.demo:spec")
    factory = getattr(importlib.import_module(module_name), attr)
    spec = dict(factory())
    if args.buckets:
        spec["batch_buckets"] = [int(b) for b in args.buckets.split(",")]
    if args.name:
        spec["name"] = args.name
    fn, params = spec.pop("fn"), spec.pop("params")
    path = pxrt.export(fn, params, args.out, overwrite=args.overwrite, **spec)
    art = pxrt.read_artifact(path)
    print(
        f"exported {art.name} to {path}: inputs "
        f"{', '.join(f'{k} {s.describe()}' for k, s in art.inputs.items())}; "
        f"buckets {list(art.batch_buckets)}"
    )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    import pxrt

    model = pxrt.load(args.path, progress=not args.json)
    info = model.describe()
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
        return 0
    m = info["manifest"]
    print(
        f"{m['name']} version {m['version']}  (format {m['format_version']}, exported with "
        f"jax {m['jax_version']}, x64={m['x64']})"
    )
    for kind in ("inputs", "outputs"):
        print(f"{kind}:")
        for t in m[kind]:
            print(f"  {t['name']:<16} {t['dtype']:<9} [n, {', '.join(map(str, t['shape']))}]")
    n_params = sum(int(np.prod(p["shape"], dtype=np.int64)) for p in m["params"])
    print(f"params: {len(m['params'])} arrays, {n_params:,} values")
    print(
        f"devices: {len(info['devices'])} ({', '.join(info['devices'])}); loaded in "
        f"{info['load_s']:.2f} s"
    )
    print(
        f"{'bucket':>7} {'per dev':>8} {'path':>6} {'compile':>9} {'GFLOP':>9} "
        f"{'MB moved':>9} {'args MB':>8} {'out MB':>7} {'temp MB':>8}"
    )
    for b in info["buckets"]:
        mem = b.get("memory", {})
        mb = lambda k, mem=mem: f"{mem[k] / 1e6:.2f}" if k in mem else "-"  # noqa: E731
        print(
            f"{b['bucket']:>7} {b['rows_per_device']:>8} "
            f"{b['path']:>6} {b['compile_s'] * 1e3:>7.0f}ms "
            f"{b.get('flops', 0) / 1e9:>9.4f} {b.get('bytes_accessed', 0) / 1e6:>9.2f} "
            f"{mb('argument_bytes'):>8} {mb('output_bytes'):>7} {mb('temp_bytes'):>8}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pxrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="export the built-in demo model, load it, run it, time it")
    p.add_argument("--keep", metavar="DIR", help="export to DIR and keep it")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("export", help="export a model to an artifact directory")
    p.add_argument(
        "spec",
        help="MODULE:FUNCTION returning a dict with fn, params, inputs and "
        "optionally batch_buckets, name, version (see pxrt.demo:spec)",
    )
    p.add_argument("out", help="the artifact directory to write")
    p.add_argument("--buckets", help="batch buckets, comma-separated (overrides the spec's)")
    p.add_argument("--name", help="model name (overrides the spec's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("serve", help="serve models over HTTP (KServe v2 / Open Inference Protocol)")
    from . import serve

    serve.add_arguments(p)
    p.set_defaults(func=serve.main)

    p = sub.add_parser("bench", help="load-test a model in-process: pxrt vs naive vs ceiling")
    from .bench import command as bench

    bench.add_arguments(p)
    p.set_defaults(func=bench.main)

    p = sub.add_parser("inspect", help="load an artifact; print its manifest and buckets")
    p.add_argument("path", help="an artifact directory written by pxrt.export")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=_cmd_inspect)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except pxrt_errors() as exc:
        print(f"pxrt: error: {exc}", file=sys.stderr)
        return 2


def pxrt_errors() -> tuple[type[BaseException], ...]:
    from pxrt import ArtifactError

    return (ArtifactError, FileNotFoundError)


if __name__ == "__main__":
    sys.exit(main())
