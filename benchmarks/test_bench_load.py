"""Load time with a cold and with a warm persistent compilation cache."""

from __future__ import annotations

import os
import shutil

import pxrt
from pxrt import artifact, demo


def _fresh(tmp_path):
    path = os.path.join(tmp_path, "mlp")
    demo.export_demo(path, buckets=(1, 8, 64))
    return path


def test_load_cold_cache(benchmark, tmp_path):
    benchmark.group = "load"
    path = _fresh(tmp_path)

    def setup():
        shutil.rmtree(os.path.join(path, artifact.CACHE_DIR), ignore_errors=True)

    benchmark.pedantic(pxrt.load, args=(path,), setup=setup, rounds=5)


def test_load_warm_cache(benchmark, tmp_path):
    benchmark.group = "load"
    path = _fresh(tmp_path)
    pxrt.load(path)  # fills the cache
    benchmark.pedantic(pxrt.load, args=(path,), rounds=5)
