"""v2 tensor decoding and encoding for every datatype, binary and JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serving import kserve


def _values(dtype: np.dtype, shape) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("datatype", list(kserve.DATATYPES))
def test_binary_round_trip(datatype):
    dtype = kserve.DATATYPES[datatype]
    x = _values(dtype, (3, 4))
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": datatype,
                    "shape": [3, 4],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ]
        }
    ).encode()
    head, tail = kserve.split_body(header + x.tobytes(), str(len(header)))
    got = kserve.decode_inputs(kserve.parse_json(head), tail)["x"]
    assert got.dtype == dtype and got.shape == (3, 4)
    np.testing.assert_array_equal(got.view(np.uint8), x.view(np.uint8))

    body, n = kserve.encode_response("m", "1", "id7", {"y": x}, [("y", True)])
    doc = json.loads(body[:n])
    assert doc["id"] == "id7" and doc["outputs"][0]["datatype"] == datatype
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == x.nbytes
    np.testing.assert_array_equal(
        np.frombuffer(body[n:], dtype).reshape(3, 4).view(np.uint8), x.view(np.uint8)
    )


@pytest.mark.parametrize("datatype", [d for d in kserve.DATATYPES if d != "BF16"])
def test_json_round_trip_flat_and_nested(datatype):
    dtype = kserve.DATATYPES[datatype]
    x = _values(dtype, (2, 3))
    for data in (x.ravel().tolist(), x.tolist()):
        doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": [2, 3], "data": data}]}
        got = kserve.decode_inputs(doc, memoryview(b""))["x"]
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, x)
    body, n = kserve.encode_response("m", "1", None, {"y": x}, [("y", False)])
    assert n is None
    out = json.loads(body)["outputs"][0]
    np.testing.assert_array_equal(np.asarray(out["data"], dtype).reshape(out["shape"]), x)


@pytest.mark.parametrize(
    "data,datatype,words",
    [
        ([300], "UINT8", "out of the range"),
        ([-1], "UINT32", "out of the range"),
        ([1.5], "INT64", "must be integers"),
        ([1], "BOOL", "true/false"),
        (["a"], "FP32", "numbers only"),
        ([[1, 2], [3]], "FP32", "ragged"),
    ],
)
def test_json_never_casts_silently(data, datatype, words):
    doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": [1], "data": data}]}
    with pytest.raises(kserve.ProtocolError, match=words):
        kserve.decode_inputs(doc, memoryview(b""))


def test_unclaimed_binary_bytes_are_an_error():
    x = np.ones(2, np.float32)
    doc = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}
        ]
    }
    with pytest.raises(kserve.ProtocolError, match="no input claims"):
        kserve.decode_inputs(doc, memoryview(x.tobytes() + b"junk"))
