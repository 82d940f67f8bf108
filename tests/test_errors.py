"""Bad requests fail alone, with errors naming the input, the expected and the got."""

from __future__ import annotations

import numpy as np
import pytest
from models import assert_matches, random_request, reference

import pxrt

GOOD = {"tokens": np.zeros((2, 5), np.int32), "features": np.zeros((2, 8), np.float16)}

BAD = [
    ("missing input", {"tokens": GOOD["tokens"]}, ValueError, ["missing input 'features'"]),
    (
        "extra input",
        dict(GOOD, extra=np.zeros((2,), np.float32)),
        ValueError,
        ["unexpected input 'extra'"],
    ),
    (
        "wrong dtype",
        dict(GOOD, features=np.zeros((2, 8), np.float32)),
        TypeError,
        ["'features'", "float16", "float32"],
    ),
    (
        "int64 for int32",
        dict(GOOD, tokens=np.zeros((2, 5), np.int64)),
        TypeError,
        ["'tokens'", "int32", "int64"],
    ),
    (
        "wrong rank",
        dict(GOOD, tokens=np.zeros((2, 5, 1), np.int32)),
        ValueError,
        ["'tokens'", "int32[n, 5]", "(2, 5, 1)"],
    ),
    ("scalar", dict(GOOD, tokens=np.int32(3)), ValueError, ["'tokens'", "()"]),
    (
        "wrong example shape",
        dict(GOOD, features=np.zeros((2, 7), np.float16)),
        ValueError,
        ["'features'", "float16[n, 8]", "(2, 7)"],
    ),
    (
        "zero rows",
        {"tokens": np.zeros((0, 5), np.int32), "features": np.zeros((0, 8), np.float16)},
        ValueError,
        ["0 rows"],
    ),
    (
        "rows disagree",
        dict(GOOD, features=np.zeros((3, 8), np.float16)),
        ValueError,
        ["'tokens' has 2", "'features' has 3"],
    ),
    ("not a mapping", [GOOD["tokens"]], TypeError, ["mapping", "list"]),
    ("not an array", dict(GOOD, tokens="hello"), TypeError, ["'tokens'"]),
    (
        "python list of floats",
        dict(GOOD, features=[[0.0] * 8] * 2),
        TypeError,
        ["'features'", "float16", "float64"],
    ),
    ("big-endian", dict(GOOD, features=np.zeros((2, 8), ">f2")), TypeError, ["'features'"]),
]


@pytest.mark.parametrize("label,request_,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_request_raises_a_clear_error(models, label, request_, exc, words):
    model = models["two_io"]
    with pytest.raises(exc) as info:
        model.run(request_)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert "two_io" in str(info.value)


def test_bad_requests_fail_alone_in_run_batch(models):
    model = models["two_io"]
    rng = np.random.default_rng(0)
    good = [random_request(model.inputs, n, rng) for n in (1, 3, 7, 2)]
    batch = [good[0], BAD[2][1], good[1], BAD[7][1], good[2], BAD[0][1], good[3]]
    outs = model.run_batch(batch, return_exceptions=True)
    assert isinstance(outs[1], TypeError)
    assert isinstance(outs[3], ValueError)
    assert isinstance(outs[5], ValueError)
    for i, g in zip((0, 2, 4, 6), good):
        assert_matches(outs[i], reference("two_io", g), f"request {i}")
    with pytest.raises(TypeError, match="'features'"):
        model.run_batch(batch)


def test_errors_are_not_cached_and_good_signatures_are(models):
    model = models["two_io"]
    handler = model.engine.input_handler
    handler.clear_routes()
    routes = handler.routes
    with pytest.raises(TypeError):
        model.run(BAD[2][1])
    assert len(routes) == 0
    model.run(GOOD)
    assert len(routes) == 1
    model.run(GOOD)
    assert len(routes) == 1
    # A cached signature with disagreeing rows still gets the full check's error.
    with pytest.raises(ValueError, match="disagree"):
        model.run(dict(GOOD, features=np.zeros((3, 8), np.float16)))


def test_run_batch_rejects_a_single_dict(models):
    with pytest.raises(TypeError, match="sequence of requests"):
        models["two_io"].run_batch(GOOD)


def test_empty_run_batch(models):
    assert models["two_io"].run_batch([]) == []


def test_request_larger_than_every_bucket_is_split_not_compiled(models):
    model = models["mlp"]
    x = np.random.default_rng(1).standard_normal((5 * model.max_batch + 3, 32)).astype(np.float32)
    want = reference("mlp", {"x": x})
    before = pxrt.compile_count()
    assert_matches(model.run({"x": x}), want)
    assert pxrt.compile_count() == before
