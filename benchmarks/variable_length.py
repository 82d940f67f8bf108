"""Variable-length inputs: the demo encoder under a long-tailed length mix, side by side.

The demo transformer encoder (``pxrt.demo.encoder``: batch buckets 1/8/32 x seq buckets
32/64/128/256), 1-row requests whose lengths follow a Pareto distribution on 8..256
(most short, a few long), through ``serving.Server``:

- grid: every cell compiled, the next cell chosen from the execution times measured at
  load (``cell_policy="cost"``: shorter requests ride along when that lowers the wait);
- oldest: the same cells, the oldest request's lane first, nothing rides along;
- padded: the same artifact loaded at seq 256 only: every request padded to the longest;
- jit: ``jax.jit(encoder)`` on each request's own shape from 4 threads (what one writes
  without pxrt: every new length compiles on the request path).

Closed loop at 64 callers (the saturated rate; alternated, ``--repeats`` times), then
Poisson arrivals at half the grid's saturated rate, grid vs oldest (the p99 the cell
choice is for). Ratios are medians over the repeats.

    python benchmarks/variable_length.py [--duration 5] [--repeats 3] [--lengths pareto:8:256]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402
from serving.bench import lengths  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lengths", default="pareto:8:256")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--no-jit", action="store_true", help="skip the jit-per-shape baseline")
    p.add_argument("--out", default="bench-results/variable_length")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pxrt-varlen-") as tmp:
        path = demo.export_encoder(os.path.join(tmp, "encoder"))
        model = pxrt.load(path, progress=True)
        padded = pxrt.load(path, dim_buckets={"seq": (max(demo.ENC_SEQ_BUCKETS),)}, progress=True)
        for b in model.engine.buckets:
            print(f"cell {b.size:>3} x seq {b.lengths[0]:>3}: {b.exec_s * 1e3:8.2f} ms")
        gc.collect()
        gc.freeze()
        lengths.bench(
            model,
            padded,
            lengths=args.lengths,
            concurrency=args.concurrency,
            duration=args.duration,
            options={"max_queue": 1 << 20},
            repeats=args.repeats,
            fn=None if args.no_jit else demo.encoder,
            out_dir=args.out,
        )


if __name__ == "__main__":
    main()
