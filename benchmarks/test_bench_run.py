"""Model.run against Compiled.__call__ + np.asarray on the same executable, per bucket."""

from __future__ import annotations

import numpy as np
import pytest
from common import BUCKETS

from pxrt import demo


@pytest.fixture(params=BUCKETS, ids=lambda b: f"B{b}")
def bucket(request, model):
    return model.size_for(request.param)


def _x(size):
    return np.random.default_rng(size).standard_normal((size, demo.WIDTH)).astype(np.float32)


def test_model_run(benchmark, model, bucket):
    benchmark.group = f"run B={bucket}"
    request = {"x": _x(bucket)}
    out = benchmark(model.run, request)
    assert out["y"].shape == (bucket, demo.WIDTH)


def test_compiled_call(benchmark, model, bucket):
    benchmark.group = f"run B={bucket}"
    compiled, params, x = model.bucket(bucket).compiled, model.params_dev, _x(bucket)
    out = benchmark(lambda: [np.asarray(o) for o in compiled(params, x)])
    assert out[0].shape == (bucket, demo.WIDTH)
