"""Open Inference Protocol conformance of `pxrt serve`: every REST response body against
the spec's schemas (`oip_schemas`), and the clients users have, unmodified: KServe's own
REST client, and tritonclient's HTTP clients (sync and asyncio)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import numpy as np
import oip_schemas as S
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
from models import MODELS, assert_matches, random_request, reference

from serving.kserve import codec

X = {"name": "x", "datatype": "FP32", "shape": [2, 32], "data": [0.25] * 64}


def infer_body(inputs, **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def binary_body(x: np.ndarray, outputs_binary: bool = True) -> tuple[bytes, dict]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": outputs_binary},
        }
    ).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


BIN_X = np.arange(64, dtype=np.float32).reshape(2, 32) / 64

# (method, path, body, headers, status, schema)
RESPONSES = [
    ("GET", "/v2/health/live", None, None, 200, S.LIVE),
    ("GET", "/v2/health/ready", None, None, 200, S.READY),
    ("GET", "/v2", None, None, 200, S.SERVER_METADATA),
    ("GET", "/v2/models/mlp", None, None, 200, S.MODEL_METADATA),
    ("GET", "/v2/models/all_dtypes/versions/1", None, None, 200, S.MODEL_METADATA),
    ("GET", "/v2/models/mlp/ready", None, None, 200, S.MODEL_READY),
    ("GET", "/v2/models/mlp/versions/1/ready", None, None, 200, S.MODEL_READY),
    ("GET", "/v2/models/two_io/config", None, None, 200, S.MODEL_CONFIG),
    ("GET", "/v2/models/mlp/stats", None, None, 200, S.MODEL_STATS),
    ("GET", "/v2/models/mlp/versions/1/stats", None, None, 200, S.MODEL_STATS),
    ("GET", "/v2/models/stats", None, None, 200, S.MODEL_STATS),
    ("POST", "/v2/models/mlp/infer", infer_body([X]), None, 200, S.INFERENCE_RESPONSE),
    (
        "POST",
        "/v2/models/mlp/versions/1/infer",
        infer_body([X], id="req-7", outputs=[{"name": "y"}]),
        None,
        200,
        S.INFERENCE_RESPONSE,
    ),
    # Errors: every one a JSON error object.
    ("GET", "/v2/models/nope", None, None, 404, S.ERROR),
    ("GET", "/v2/models/nope/ready", None, None, 404, S.ERROR),
    ("GET", "/v2/models/mlp/versions/9", None, None, 404, S.ERROR),
    ("GET", "/v2/models/mlp/versions/9/ready", None, None, 404, S.ERROR),
    ("GET", "/v2/nothing/here", None, None, 404, S.ERROR),
    ("GET", "/", None, None, 404, S.ERROR),
    ("GET", "/v2/models/mlp/infer", None, None, 405, S.ERROR),
    ("DELETE", "/v2/health/live", None, None, 405, S.ERROR),
    ("POST", "/v2/models/mlp/infer", b"{not json", None, 400, S.ERROR),
    ("POST", "/v2/models/mlp/infer", infer_body([]), None, 400, S.ERROR),
    ("POST", "/v2/models/mlp/infer", infer_body([X], id=7), None, 400, S.ERROR),
    ("POST", "/v2/models/mlp/infer", infer_body([dict(X, datatype="FP64")]), None, 400, S.ERROR),
    ("POST", "/v2/models/nope/infer", infer_body([X]), None, 404, S.ERROR),
    ("POST", "/v2/models/mlp/infer", b"0" * (2 << 20), None, 413, S.ERROR),
    (
        "POST",
        "/v2/models/mlp/infer",
        infer_body([X], parameters={"timeout": 1}),
        None,
        504,
        S.ERROR,
    ),
]


@pytest.mark.parametrize(
    "method,path,body,headers,status,schema",
    RESPONSES,
    ids=[f"{r[0]} {r[1]} {r[4]}" for r in RESPONSES],
)
def test_every_response_body_follows_the_spec(served, method, path, body, headers, status, schema):
    r = httpx.request(method, served.url + path, content=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    doc = r.json()
    jsonschema.validate(doc, schema)
    if path.startswith("/v2/models/") and path.endswith("/ready") and status == 200:
        assert doc == {"name": path.split("/")[3], "ready": True}
    if path == "/v2/models/stats":
        names = {s["name"] for s in doc["model_stats"]}
        assert {"mlp", "two_io", "bf16", "all_dtypes", "tiny_queue"} <= names
    if body and b'"id": "req-7"' in body:
        assert doc["id"] == "req-7"  # echoed, as the spec requires


def test_binary_responses_have_a_conforming_json_header(served):
    body, headers = binary_body(BIN_X)
    r = httpx.post(served.url + "/v2/models/mlp/infer", content=body, headers=headers)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    n = int(r.headers["inference-header-content-length"])
    header = json.loads(r.content[:n])
    jsonschema.validate(header, S.INFERENCE_RESPONSE)
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert sum(sizes) == len(r.content) - n
    y = np.frombuffer(r.content[n:], np.float32).reshape(header["outputs"][0]["shape"])
    assert_matches({"y": y}, reference("mlp", {"x": BIN_X}))


def test_every_datatype_round_trips_in_a_conforming_body(served):
    request = random_request(MODELS["all_dtypes"]["inputs"], 3, np.random.default_rng(1))
    inputs = [
        {
            "name": k,
            "datatype": codec.datatype_of(v.dtype),
            "shape": list(v.shape),
            # BF16 has no JSON form in the protocol: its data go as FP32 values.
            "data": (v.astype(np.float32) if v.dtype.name == "bfloat16" else v).ravel().tolist(),
        }
        for k, v in request.items()
    ]
    r = httpx.post(served.url + "/v2/models/all_dtypes/infer", content=infer_body(inputs))
    assert r.status_code == 200, r.text
    jsonschema.validate(r.json(), S.INFERENCE_RESPONSE)


def test_not_ready_and_draining_bodies_follow_the_spec(run):
    from serving import Server
    from serving.http.app import create_app

    server = Server(ready=False)
    app = create_app(server)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as http:
            for draining in (False, True):
                server.ready, server.draining = draining, draining
                r = await http.get("/v2/health/ready")
                assert r.status_code == 503
                jsonschema.validate(r.json(), S.READY)
                jsonschema.validate(r.json(), S.ERROR)
                assert r.json()["ready"] is False
                r = await http.get("/v2/health/live")
                assert r.status_code == 200 and r.json() == {"live": True}

    run(main)


# --------------------------------------------------------------------------- clients


def test_kserve_rest_client(served, run):
    """KServe's own InferenceRESTClient (v2), unmodified: health, JSON and binary
    inference compared with plain JAX, and an error carrying the server's message."""
    rng = np.random.default_rng(3)

    async def main():
        client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0))
        try:
            assert await client.is_server_live(served.url) is True
            assert await client.is_server_ready(served.url) is True
            assert await client.is_model_ready(served.url, "two_io") is True
            assert await client.is_model_ready(served.url, "nope") is False
            # KServe's client sends FP16 only as binary: JSON with the float32 model,
            # binary with the int32 + float16 one.
            for name, binary in (("mlp", False), ("two_io", True)):
                request = random_request(MODELS[name]["inputs"], 3, rng)
                inputs = []
                for k, v in request.items():
                    inp = InferInput(k, list(v.shape), codec.datatype_of(v.dtype))
                    inp.set_data_from_numpy(v, binary_data=binary)
                    inputs.append(inp)
                result = await client.infer(
                    served.url, InferRequest(name, inputs, request_id="k-1"), name
                )
                assert result.id == "k-1" and result.model_name == name
                got = {o.name: o.as_numpy() for o in result.outputs}
                assert_matches(got, reference(name, request), f"{name} binary={binary}")
            bad = InferInput("x", [1, 31], "FP32")
            bad.set_data_from_numpy(np.ones((1, 31), np.float32), binary_data=False)
            with pytest.raises(httpx.HTTPStatusError, match=r"float32\[n, 32\]"):
                await client.infer(served.url, InferRequest("mlp", [bad]), "mlp")
        finally:
            await client.close()

    run(main)


def test_tritonclient_asyncio(served, run):
    """tritonclient.http.aio, unmodified (the sync client is driven in test_http)."""
    x = np.random.default_rng(4).standard_normal((3, 32)).astype(np.float32)

    async def main():
        client = triton_aio.InferenceServerClient(served.url.removeprefix("http://"))
        try:
            assert await client.is_server_live() and await client.is_server_ready()
            assert await client.is_model_ready("mlp")
            meta = await client.get_model_metadata("mlp")
            assert meta["inputs"][0]["shape"] == [-1, 32]
            stats = await client.get_inference_statistics()  # all models
            assert {s["name"] for s in stats["model_stats"]} >= {"mlp", "two_io"}
            results = []
            for binary in (False, True):
                inp = triton_aio.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x, binary_data=binary)
                out = triton_aio.InferRequestedOutput("y", binary_data=binary)
                results.append(await client.infer("mlp", [inp], outputs=[out]))
            return [r.as_numpy("y") for r in results]
        finally:
            await client.close()

    for y in run(main):
        assert_matches({"y": y}, reference("mlp", {"x": x}))


def test_tritonclient_sync_stats_of_all_models(served):
    client = triton.InferenceServerClient(served.url.removeprefix("http://"))
    try:
        stats = client.get_inference_statistics()
        assert {s["name"] for s in stats["model_stats"]} >= {"mlp", "bf16"}
        # A model can still be named "stats": its own endpoints take a version.
        assert client.get_inference_statistics("mlp")["model_stats"][0]["name"] == "mlp"
    finally:
        client.close()


def test_routing_errors_keep_the_connection(served):
    """404 and 405 from routing are JSON errors on a connection that stays usable."""
    with httpx.Client(base_url=served.url, timeout=10) as http:
        for _ in range(3):
            r = http.get("/v2/missing")
            assert r.status_code == 404 and "no endpoint" in r.json()["error"]
            r = http.put("/v2/models/mlp/infer")
            assert r.status_code == 405 and "POST" in r.json()["error"]
        assert http.get("/v2/health/live").json() == {"live": True}


def test_asyncio_client_gather(served, run):
    """Many concurrent requests from one asyncio client: each its own answer."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((int(rng.integers(1, 5)), 32)).astype(np.float32) for _ in range(16)]

    async def main():
        client = triton_aio.InferenceServerClient(served.url.removeprefix("http://"))
        try:

            async def one(x):
                inp = triton_aio.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                return (await client.infer("mlp", [inp])).as_numpy("y")

            return await asyncio.gather(*(one(x) for x in xs))
        finally:
            await client.close()

    for x, y in zip(xs, run(main)):
        assert_matches({"y": y}, reference("mlp", {"x": x}))
