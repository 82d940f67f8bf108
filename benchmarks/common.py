"""Shared set-up for the benchmarks: the demo model and 64-request workloads."""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pxrt  # noqa: E402
from pxrt import _handlers_py, demo  # noqa: E402

BUCKETS = (1, 8, 64)


def demo_model(tmp: str | None = None, buckets=BUCKETS) -> pxrt.Model:
    """The demo MLP as one program over every device: these benchmarks time the
    engine's own path on one and on several devices (benchmarks/placement.py compares
    the placements)."""
    path = os.path.join(tmp or tempfile.mkdtemp(prefix="pxrt-bench-"), "mlp")
    demo.export_demo(path, buckets=buckets)
    return pxrt.load(path, placement="sharded")


def three_input_request(rows: int = 4) -> dict:
    return {
        "tokens": np.zeros((rows, 16), np.int32),
        "mask": np.ones((rows, 16), np.bool_),
        "features": np.zeros((rows, 64), np.float32),
    }


def handlers(impl, rows_per_request=(1, 2, 3, 1, 1, 4, 2, 1)):
    """An input and a result handler for a 3-input model, 64 requests of mixed rows,
    staging for them, and fake per-device outputs."""
    names, dtypes, shapes = (
        ["tokens", "mask", "features"],
        [np.int32, np.bool_, np.float32],
        [(16,), (16,), (64,)],
    )
    ih = impl.InputHandler("bench", names, dtypes, shapes)
    rh = impl.ResultHandler(["y"], [np.float32], [(64,)])
    rows = [rows_per_request[i % len(rows_per_request)] for i in range(64)]
    requests = [three_input_request(r) for r in rows]
    total = sum(rows)
    bucket = 1 << (total - 1).bit_length()
    buffers = [np.empty((bucket,) + s, d) for d, s in zip(dtypes, shapes)]
    outputs = [[np.zeros((bucket // 4, 64), np.float32) for _ in range(4)]]
    offsets = list(np.cumsum([0] + rows[:-1]).tolist())
    return ih, rh, requests, rows, buffers, outputs, offsets, bucket


def assemble_split(ih, rh, requests, rows, buffers, outputs, offsets, bucket):
    prepared = [ih.prepare(r)[0] for r in requests]
    ih.assemble(prepared, [0] * len(rows), rows, buffers)
    return rh.split(outputs, bucket // 4, offsets, rows)


def numpy_way(requests, rows, bucket, outputs):
    """The obvious way without pxrt's handlers: concatenate, pad, split."""
    names = ("tokens", "mask", "features")
    batch = {}
    total = sum(rows)
    for n in names:
        x = np.concatenate([r[n] for r in requests])
        batch[n] = np.pad(x, [(0, bucket - total)] + [(0, 0)] * (x.ndim - 1))
    y = np.concatenate(outputs[0])[:total]
    return [{"y": part} for part in np.split(y, np.cumsum(rows)[:-1])]


try:
    from pxrt import _handlers as _handlers_c
    from pxrt import _keys as _keys_c
except ImportError:  # pragma: no cover
    _handlers_c = _keys_c = None

__all__ = ["_handlers_c", "_handlers_py", "_keys_c"]
