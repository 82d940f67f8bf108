"""Assemble 64 requests + split their outputs; signature keys of a 3-input request."""

from __future__ import annotations

import pytest
from common import (
    _handlers_c,
    _handlers_py,
    _keys_c,
    assemble_split,
    handlers,
    numpy_way,
    three_input_request,
)

from pxrt import _keys_py

IMPLS = [pytest.param(_handlers_py, id="python")]
if _handlers_c is not None:
    IMPLS.insert(0, pytest.param(_handlers_c, id="cython"))


@pytest.mark.parametrize("impl", IMPLS)
def test_assemble_split_64(benchmark, impl):
    benchmark.group = "assemble + split, 64 requests"
    args = handlers(impl)
    out = benchmark(assemble_split, *args)
    assert len(out) == 64


def test_numpy_concat_pad_split_64(benchmark):
    benchmark.group = "assemble + split, 64 requests"
    _, _, requests, rows, _, outputs, _, bucket = handlers(_handlers_py)
    out = benchmark(numpy_way, requests, rows, bucket, outputs)
    assert len(out) == 64


KEYS = [pytest.param(_keys_py, id="python")]
if _keys_c is not None:
    KEYS.insert(0, pytest.param(_keys_c, id="cython"))


@pytest.mark.parametrize("keys", KEYS)
def test_signature_key_3_inputs(benchmark, keys):
    benchmark.group = "signature key, 3 inputs"
    request = three_input_request()
    assert benchmark(keys.signature, request) is not None
