"""Load time in process: cold (an empty cache directory each round) and warm (the
executables, proven paths and cell times a first load stored). Fresh processes, and the
serve / reload / Ray start-up: benchmarks/load_times.py."""

from __future__ import annotations

import itertools
import os

import pxrt
from pxrt import demo


def _fresh(tmp_path):
    path = os.path.join(tmp_path, "mlp")
    demo.export_demo(path, buckets=(1, 8, 64))
    return path


def test_load_cold_cache(benchmark, tmp_path):
    benchmark.group = "load"
    path = _fresh(tmp_path)
    rounds = itertools.count()

    def setup():
        return (path,), {"compilation_cache": os.path.join(tmp_path, f"cold-{next(rounds)}")}

    benchmark.pedantic(pxrt.load, setup=setup, rounds=5)


def test_load_warm_cache(benchmark, tmp_path):
    benchmark.group = "load"
    path = _fresh(tmp_path)
    cache = os.path.join(tmp_path, "warm")
    pxrt.load(path, compilation_cache=cache)  # stores what the next loads read
    benchmark.pedantic(pxrt.load, args=(path,), kwargs={"compilation_cache": cache}, rounds=5)
