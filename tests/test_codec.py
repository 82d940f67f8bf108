"""v2 tensor decoding and encoding for every datatype, binary and JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.kserve import codec

# The Cython modules end to end: `make test` also runs this module with their pure-Python
# twins (PXRT_NO_EXTENSIONS=1, on one device).
pytestmark = [pytest.mark.twins]


try:
    from serving.kserve import _tensors  # noqa: F401
except ImportError:  # pragma: no cover - only when the extensions are not built
    _tensors = None
needs_tensors_ext = pytest.mark.skipif(_tensors is None, reason="Cython extensions not built")


def _values(dtype: np.dtype, shape) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("datatype", list(codec.DATATYPES))
def test_binary_round_trip(datatype):
    dtype = codec.DATATYPES[datatype]
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
    head, tail = codec.split_body(header + x.tobytes(), str(len(header)))
    got = codec.decode_inputs(codec.parse_json(head), tail)["x"]
    assert got.dtype == dtype and got.shape == (3, 4)
    np.testing.assert_array_equal(got.view(np.uint8), x.view(np.uint8))

    body, n = codec.encode_response("m", "1", "id7", {"y": x}, [("y", True)])
    doc = json.loads(body[:n])
    assert doc["id"] == "id7" and doc["outputs"][0]["datatype"] == datatype
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == x.nbytes
    np.testing.assert_array_equal(
        np.frombuffer(body[n:], dtype).reshape(3, 4).view(np.uint8), x.view(np.uint8)
    )


@pytest.mark.parametrize("datatype", [d for d in codec.DATATYPES if d != "BF16"])
def test_json_round_trip_flat_and_nested(datatype):
    dtype = codec.DATATYPES[datatype]
    x = _values(dtype, (2, 3))
    for data in (x.ravel().tolist(), x.tolist()):
        doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": [2, 3], "data": data}]}
        got = codec.decode_inputs(doc, memoryview(b""))["x"]
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, x)
    body, n = codec.encode_response("m", "1", None, {"y": x}, [("y", False)])
    assert n is None
    out = json.loads(body)["outputs"][0]
    np.testing.assert_array_equal(np.asarray(out["data"], dtype).reshape(out["shape"]), x)


@pytest.mark.parametrize(
    "data,datatype,shape,words",
    [
        ([300], "UINT8", [1], "element 0 is 300: out of range"),
        ([-129], "INT8", [1], "element 0 is -129: out of range"),
        ([-1], "UINT32", [1], "element 0 is -1: out of range"),
        ([2**63], "INT64", [1], "out of range"),
        ([1.5], "INT64", [1], "element 0 is 1.5: expected an integer"),
        ([1.0], "INT32", [1], "element 0 is 1.0: expected an integer"),
        ([1, True], "INT32", [2], "element 1 is true: expected an integer"),
        ([True], "FP32", [1], "element 0 is true: expected a number"),
        ([1], "BOOL", [1], "element 0 is 1: expected true or false"),
        (["a"], "FP32", [1], "element 0 is 'a': expected a number"),
        ([None], "FP16", [1], "element 0 is null"),
        ([1e39], "FP32", [1], r"element 0 is 1e\+39: out of range"),
        ([65520.0], "FP16", [1], "element 0 is 65520.0: out of range"),
        ([-(10**400)], "FP64", [1], "out of range"),
        ([1e300], "BF16", [1], "out of range"),
        ([[1, 2], [3]], "FP32", [2, 2], "a list of 1 at nesting level 2"),
        ([[1, 2], 3], "FP32", [2, 2], "expected a list of 2 at nesting level 2"),
        ([[[1]], [[2]]], "FP32", [2, 1], r"element 0 is \[1\]"),
        ([1, 2, 3], "FP32", [2, 2], "3 values where shape \\[2, 2\\] needs 4"),
        ([[1, 2]], "FP32", [2, 2], "a list of 1 at nesting level 1"),
        ({"a": 1}, "FP32", [1], "'data' must be a list"),
    ],
)
def test_json_never_casts_silently(data, datatype, shape, words):
    doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}
    with pytest.raises(codec.ProtocolError, match=words):
        codec.decode_inputs(doc, memoryview(b""))


@pytest.mark.parametrize(
    "doc,words",
    [
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2**62, 0], "data": []}]},
            "more than",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 2**62], "data": []}]},
            "more than",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1] * 40, "data": [1]}]},
            "at most 32",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": [1],
                        "data": [1.0],
                        "parameters": {"binary_data_size": 4},
                    }
                ]
            },
            "both 'data' and binary_data_size",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": [1],
                        "data": [1.0],
                        "parameters": [1],
                    }
                ]
            },
            "'parameters' must be an object",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": [1],
                        "parameters": {"binary_data_size": True},
                    }
                ]
            },
            "non-negative int",
        ),
        (
            {"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], "data": [1.0]}]},
            "unexpected input 'q'; the model takes 'x'",
        ),
        (
            {
                "inputs": [
                    {"name": f"i{k}", "datatype": "FP32", "shape": [1], "data": [1.0]}
                    for k in range(3)
                ]
            },
            "the request has 3 inputs; the model takes 1",
        ),
    ],
)
def test_malformed_requests_are_protocol_errors(doc, words):
    with pytest.raises(codec.ProtocolError, match=words):
        codec.decode_inputs(doc, memoryview(b""), {"x": object()})


@pytest.mark.parametrize(
    "doc,words",
    [
        ({"outputs": [{"name": "y", "parameters": [1]}]}, "'parameters' must be an object"),
        ({"outputs": [{"name": "y", "parameters": "binary"}]}, "'parameters' must be an object"),
        ({"outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]}, "true or false"),
        ({"parameters": {"binary_data_output": 1}}, "true or false"),
        ({"parameters": "x"}, "'parameters' must be an object"),
        ({"outputs": {"name": "y"}}, "'outputs' must be a list"),
        ({"outputs": [{"name": ["y"]}]}, "unknown output"),
        ({"outputs": [{"name": "y"}] * 3}, "asks for 3 outputs"),
    ],
)
def test_malformed_output_requests_are_protocol_errors(doc, words):
    with pytest.raises(codec.ProtocolError, match=words):
        codec.requested_outputs(doc, ["y"])


@pytest.mark.parametrize("value", ["1_0", "١٠", " 10", "-1", "1e3", "0x10", "9" * 30])
def test_header_length_is_a_plain_decimal(value):
    with pytest.raises(codec.ProtocolError, match="decimal byte count"):
        codec.split_body(b"x" * 20, value)
    assert bytes(codec.split_body(b"x" * 20, "10")[0]) == b"x" * 10


def test_unclaimed_binary_bytes_are_an_error():
    x = np.ones(2, np.float32)
    doc = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}
        ]
    }
    with pytest.raises(codec.ProtocolError, match="no input claims"):
        codec.decode_inputs(doc, memoryview(x.tobytes() + b"junk"))


# --------------------------------------------------------------------------- the decoder twins

_scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.none(),
    st.text(max_size=3),
)
_data = st.recursive(st.lists(_scalars, max_size=6), lambda inner: st.lists(inner, max_size=4))


@needs_tensors_ext
@settings(max_examples=400, deadline=None)
@given(
    data=st.one_of(_data, _scalars),
    shape=st.lists(st.integers(0, 4), max_size=3).map(tuple),
    datatype=st.sampled_from(list(codec.DATATYPES)),
)
def test_json_decoder_twins_agree(data, shape, datatype):
    from serving.kserve import _tensors, _tensors_py

    kind, bounds = codec._LIMITS[codec.DATATYPES[datatype]]
    answers = []
    for impl in (_tensors, _tensors_py):
        try:
            out = impl.decode(data, shape, kind, *bounds)
            answers.append(("ok", out.dtype, out.tolist()))
        except impl.TensorDataError as exc:
            answers.append(("error", str(exc)))
    assert answers[0] == answers[1]


def test_a_binary_header_seen_before_decodes_as_the_first_time(models):
    # InferRequest.from_json remembers a binary request's header per model: the same
    # header with new bytes decodes to the new bytes' arrays; a tail of another length
    # takes the full decode (and its error); another model decodes it against its own
    # inputs, not the first model's plan.
    from serving.kserve.core import InferRequest

    mlp, two_io = models["mlp"], models["two_io"]
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((2, 32)).astype(np.float32) for _ in range(3)]
    header = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 32],
                     "parameters": {"binary_data_size": xs[0].nbytes}}],
         "outputs": [{"name": "y", "parameters": {"binary_data": True}}], "id": "same"}
    ).encode()  # fmt: skip
    for x in xs:
        got = InferRequest.from_json(header, memoryview(x.tobytes()), mlp)
        np.testing.assert_array_equal(got.inputs["x"], x)
        assert got.outputs == [("y", True)] and got.id == "same" and got.timeout_s is None
    with pytest.raises(codec.ProtocolError, match="truncated binary data"):
        InferRequest.from_json(header, memoryview(xs[0].tobytes()[:-4]), mlp)
    with pytest.raises(codec.ProtocolError, match="unexpected input 'x'"):
        InferRequest.from_json(header, memoryview(xs[0].tobytes()), two_io)
    # JSON tensors are not remembered: their values are in the header.
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0.5] * 32}]}
    first = InferRequest.from_json(json.dumps(doc).encode(), memoryview(b""), mlp)
    doc["inputs"][0]["data"] = [1.5] * 32
    second = InferRequest.from_json(json.dumps(doc).encode(), memoryview(b""), mlp)
    assert first.inputs["x"][0, 0] == 0.5 and second.inputs["x"][0, 0] == 1.5


def test_a_requests_priority_and_its_remembered_header(models):
    """``parameters.priority`` (Triton's) is read from the JSON header, and a header seen
    before (its plan remembered) gives the same; anything but an integer from 0 to
    2**63-1 is a protocol error naming it."""
    from serving.kserve.core import InferRequest

    x = np.ones((2, 32), np.float32)
    for priority in (None, 0, 1, 3):
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 32],
                           "parameters": {"binary_data_size": x.nbytes}}]}  # fmt: skip
        if priority is not None:
            doc["parameters"] = {"priority": priority}
        header = json.dumps(doc).encode()
        for _ in range(2):  # (the second: from the remembered plan)
            request = InferRequest.from_json(header, memoryview(x.tobytes()), models["mlp"])
            assert request.priority == (priority or 0)
    for bad in (-1, 1.5, "1", True, 2**63, 2**64 - 1):  # (2**63: beyond the queue's C int)
        with pytest.raises(codec.ProtocolError, match="parameters.priority must be an integer"):
            codec.priority_of({"parameters": {"priority": bad}})
    assert codec.priority_of({"parameters": {"priority": 2**63 - 1}}) == 2**63 - 1
