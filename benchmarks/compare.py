"""Side-by-side comparisons for the closing notes: every ratio here is measured in one
process, alternatives interleaved round by round.

    python benchmarks/compare.py            # 1 device
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/compare.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import jax
import numpy as np
from common import (
    _handlers_c,
    _handlers_py,
    _keys_c,
    assemble_split,
    demo_model,
    handlers,
    numpy_way,
    three_input_request,
)

import pxrt
from pxrt import _keys_py, demo
from pxrt.timing import compare, fmt_time


def bench_run(rounds: int, calls: int) -> None:
    model = demo_model()
    print(f"\n## Model.run vs Compiled.__call__ + np.asarray ({len(model.devices)} device(s))")
    print(f"{'bucket':>7} {'Model.run':>11} {'Compiled':>11} {'ratio':>7}")
    for size in model.buckets:
        x = np.random.default_rng(size).standard_normal((size, demo.WIDTH)).astype(np.float32)
        request, compiled, params = {"x": x}, model.bucket(size).compiled, model.params_dev
        t = compare(
            {
                "pxrt": lambda r=request: model.run(r),
                "jax": lambda c=compiled, x=x, p=params: [np.asarray(o) for o in c(p, x)],
            },
            rounds=rounds,
            calls=calls,
        )
        print(
            f"{size:>7} {fmt_time(t['pxrt']):>11} {fmt_time(t['jax']):>11} "
            f"{t['pxrt'] / t['jax']:>6.2f}x"
        )


def bench_handlers(rounds: int, calls: int) -> None:
    print("\n## assemble 64 requests (3 inputs) + split their outputs")
    alts = {}
    for label, impl in (("cython", _handlers_c), ("python", _handlers_py)):
        if impl is not None:
            args = handlers(impl)
            alts[label] = lambda a=args: assemble_split(*a)
    ih, rh, requests, rows, buffers, outputs, offsets, bucket = handlers(_handlers_py)
    alts["numpy concat/pad/split"] = lambda: numpy_way(requests, rows, bucket, outputs)
    t = compare(alts, rounds=rounds, calls=calls)
    base = t.get("cython", next(iter(t.values())))
    for k, v in t.items():
        print(f"  {k:<24} {fmt_time(v):>10}  {v / base:>6.2f}x the Cython time")

    print("\n## signature key of a 3-input request")
    req = three_input_request()
    alts = {"python": lambda: _keys_py.signature(req)}
    if _keys_c is not None:
        alts = {"cython": lambda: _keys_c.signature(req), **alts}
    t = compare(alts, rounds=rounds, calls=calls * 20)
    for k, v in t.items():
        print(f"  {k:<24} {v * 1e9:>8.0f} ns")


def bench_load(rounds: int) -> None:
    print("\n## load: cold vs warm compilation cache (demo model, 3 buckets)")
    cold, warm = [], []
    for _ in range(rounds):
        tmp = tempfile.mkdtemp(prefix="pxrt-load-")
        try:
            path = demo.export_demo(os.path.join(tmp, "mlp"), buckets=(1, 8, 64))
            t0 = time.perf_counter()
            pxrt.load(path)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pxrt.load(path)
            warm.append(time.perf_counter() - t0)
        finally:
            shutil.rmtree(tmp)
    c, w = float(np.median(cold)), float(np.median(warm))
    print(f"  cold {fmt_time(c)}   warm {fmt_time(w)}   warm/cold {w / c:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, {jax.device_count()} device(s), "
        f"Cython extensions built: {_handlers_c is not None}"
    )
    bench_run(args.rounds, args.calls)
    bench_handlers(args.rounds, args.calls)
    bench_load(max(3, args.rounds // 2))


if __name__ == "__main__":
    main()
