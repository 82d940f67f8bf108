"""The infer endpoint against random bodies: every answer is a 2xx or a clear 4xx with a
short JSON error, never a 5xx, and the server is healthy afterwards."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DATATYPES = ["BOOL", "INT8", "INT32", "INT64", "UINT8", "UINT64", "FP16", "FP32", "FP64", "BF16"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)
shapes = st.one_of(
    st.lists(st.integers(0, 40), max_size=4),
    st.lists(st.integers(-(2**63), 2**63), max_size=3),
    json_values,
)
tensors = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.sampled_from(["x", "y", "tokens"]), json_values),
        "datatype": st.one_of(st.sampled_from(DATATYPES), json_values),
        "shape": shapes,
        "data": st.one_of(
            st.lists(st.floats(-1e3, 1e3, allow_nan=False), max_size=70),
            st.lists(st.lists(scalars, max_size=33), max_size=3),
            json_values,
        ),
        "parameters": st.one_of(
            st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-4, 300)}),
            json_values,
        ),
    },
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "id": json_values,
        "inputs": st.one_of(st.lists(tensors, max_size=3), json_values),
        "outputs": st.one_of(
            st.lists(st.fixed_dictionaries({"name": st.sampled_from(["y", "z"])}), max_size=2),
            json_values,
        ),
        "parameters": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "timeout": st.one_of(st.integers(-5, 10**7), json_values),
                    "binary_data_output": json_values,
                },
            ),
            json_values,
        ),
    },
)


@pytest.fixture(scope="module")
def http():
    """One client for the fuzzing (a client per request costs more than the request)."""
    with httpx.Client(timeout=30) as client:
        yield client


def _a_good_request_works(url: str) -> None:
    x = np.ones((2, 32), np.float32)
    body = json.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [2, 32], "data": x.ravel().tolist()}
            ]
        }
    )
    r = httpx.post(url + "/v2/models/mlp/infer", content=body, timeout=30)
    assert r.status_code == 200, r.text


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    doc=requests,
    raw=st.one_of(st.none(), st.binary(max_size=64)),
    header_length=st.one_of(st.none(), st.text(max_size=6), st.integers(-3, 500).map(str)),
    tail=st.binary(max_size=300),
    model=st.sampled_from(["mlp", "two_io", "all_dtypes"]),
)
def test_fuzzed_infer_requests_never_get_a_5xx(served, http, doc, raw, header_length, tail, model):
    body = raw if raw is not None else json.dumps(doc).encode() + tail
    headers = {"content-type": "application/octet-stream"}
    if (
        header_length  # a value an HTTP client can send: printable ASCII, no edge spaces
        and header_length.isprintable()
        and header_length.isascii()
        and header_length.strip() == header_length
    ):
        headers["inference-header-content-length"] = header_length
    r = http.post(f"{served.url}/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code < 500 or r.status_code == 503, (r.status_code, r.text[:500])
    if r.status_code != 200:
        assert r.headers["content-type"] == "application/json"
        assert len(r.json()["error"]) < 1000


def test_the_server_is_healthy_after_the_fuzzing(served):
    assert httpx.get(served.url + "/v2/health/ready", timeout=10).json() == {"ready": True}
    _a_good_request_works(served.url)


def test_many_tiny_inputs_are_refused_quickly_and_briefly(served):
    """Refused before any input is decoded, with an error that does not list them all
    (this server's body limit is 1 MB; larger bodies get 413 before they are read)."""
    doc = {
        "inputs": [
            {"name": f"i{k}", "datatype": "FP32", "shape": [1], "data": [0]} for k in range(12_000)
        ]
    }
    r = httpx.post(served.url + "/v2/models/mlp/infer", content=json.dumps(doc), timeout=30)
    assert r.status_code == 400 and "the model takes 1" in r.json()["error"]
    assert len(r.content) < 500
    _a_good_request_works(served.url)
