"""`pxrt serve` as a real process, driven by the unmodified Triton HTTP client and raw HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from models import MODELS, assert_matches, encoder_reference, random_request, reference
from prometheus_client.parser import text_string_to_metric_families
from servers import ROOT, ServeProcess
from tritonclient.utils import InferenceServerException

from serving.kserve import codec


@pytest.fixture
def client(served):
    c = triton.InferenceServerClient(served.url.removeprefix("http://"))
    yield c
    c.close()


def triton_infer(client, name, request, binary):
    # tritonclient sends and reads BF16 only as binary data.
    inputs = []
    for k, v in request.items():
        datatype = codec.datatype_of(v.dtype)
        inp = triton.InferInput(k, list(v.shape), datatype)
        inp.set_data_from_numpy(v, binary_data=binary or datatype == "BF16")
        inputs.append(inp)
    bf16_out = {"bf16", "output"} if name in ("bf16", "all_dtypes") else set()
    outputs = [
        triton.InferRequestedOutput(k, binary_data=binary or k in bf16_out)
        for k in MODELS_OUTPUTS[name]
    ]
    result = client.infer(name, inputs, outputs=outputs)
    return {k: result.as_numpy(k) for k in MODELS_OUTPUTS[name]}


MODELS_OUTPUTS = {
    "mlp": ["y"],
    "two_io": ["argmax", "scores"],
    "bf16": ["output"],
    "all_dtypes": ["bf16", "f16", "f32", "flag", "i32", "i64", "u8"],
}


# --------------------------------------------------------------------------- the client


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp")
    meta = client.get_server_metadata()
    assert "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("two_io")
    assert model["inputs"] == [
        {"name": "tokens", "datatype": "INT32", "shape": [-1, 5]},
        {"name": "features", "datatype": "FP16", "shape": [-1, 8]},
    ]
    assert client.get_model_metadata("mlp", model_version="1")["versions"] == ["1"]


def test_model_config_as_triton_tools_read_it(client):
    config = client.get_model_config("two_io")
    assert config["max_batch_size"] == 8
    assert config["input"][1] == {"name": "features", "data_type": "TYPE_FP16", "dims": [8]}
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("name", ["mlp", "two_io", "bf16", "all_dtypes"])
def test_inference_matches_jax(client, name, binary):
    rng = np.random.default_rng(hash(name) % 1000)
    for rows in (1, 3, 2 * MODELS[name]["buckets"][-1] + 1):
        request = random_request({k: s for k, s in MODELS[name]["inputs"].items()}, rows, rng)
        got = triton_infer(client, name, request, binary)
        want = reference(name, request)
        assert_matches(got, want, f"{name} rows={rows} binary={binary}")


def test_statistics(client):
    stats = client.get_inference_statistics("mlp")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] >= 1
    assert stats["execution_count"] >= 1


# --------------------------------------------------------------------------- raw HTTP errors


def post(served, path, body, headers=None):
    return httpx.post(served.url + path, content=body, headers=headers or {}, timeout=30)


def infer_json(inputs, **extra):
    return json.dumps({"inputs": inputs, **extra}).encode()


X = {"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0.5] * 32}

ERRORS = [
    ("malformed json", "/v2/models/mlp/infer", b"{not json", None, 400, "malformed JSON"),
    (
        "bad datatype",
        "/v2/models/mlp/infer",
        infer_json([dict(X, datatype="FP8")]),
        None,
        400,
        "unsupported datatype",
    ),
    (
        "shape/data mismatch",
        "/v2/models/mlp/infer",
        infer_json([dict(X, shape=[2, 32])]),
        None,
        400,
        "32 values where shape [2, 32] needs 64",
    ),
    (
        "float for int",
        "/v2/models/two_io/infer",
        infer_json(
            [
                {"name": "tokens", "datatype": "INT32", "shape": [1, 5], "data": [1.5] * 5},
                {"name": "features", "datatype": "FP16", "shape": [1, 8], "data": [0] * 8},
            ]
        ),
        None,
        400,
        "element 0 is 1.5: expected an integer",
    ),
    (
        "validation: wrong dtype",
        "/v2/models/mlp/infer",
        infer_json([dict(X, datatype="FP64")]),
        None,
        400,
        "expected dtype float32, got float64",
    ),
    (
        "validation: missing input",
        "/v2/models/two_io/infer",
        infer_json([{"name": "tokens", "datatype": "INT32", "shape": [1, 5], "data": [1] * 5}]),
        None,
        400,
        "missing input 'features'",
    ),
    (
        "unknown output",
        "/v2/models/mlp/infer",
        infer_json([X], outputs=[{"name": "z"}]),
        None,
        400,
        "unknown output 'z'",
    ),
    ("unknown model", "/v2/models/nope/infer", infer_json([X]), None, 404, "no model named"),
    (
        "unknown version",
        "/v2/models/mlp/versions/7/infer",
        infer_json([X]),
        None,
        404,
        "no version '7'",
    ),
    (
        "more rows than the queue holds",
        "/v2/models/tiny_queue/infer",
        infer_json([dict(X, shape=[2, 32], data=[0.5] * 64)]),
        None,
        400,
        "holds at most 1 (max_queue)",
    ),
    (
        "deadline",
        "/v2/models/mlp/infer",
        infer_json([X], parameters={"timeout": 1}),
        None,
        504,
        "deadline",
    ),
]


@pytest.mark.parametrize("label,path,body,headers,status,words", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(served, label, path, body, headers, status, words):
    r = post(served, path, body, headers)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]
    if status == 429:
        assert int(r.headers["retry-after"]) >= 1


def _binary_request(x: np.ndarray, claim: int) -> tuple[bytes, dict]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "parameters": {"binary_data_size": claim},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


@pytest.mark.parametrize("server", ["served", "served_workers"])
def test_a_priority_out_of_range_is_a_400_naming_it(request, server):
    """Triton's ``priority`` from 2**63 (beyond the queue's C integer: it was a 500) or
    not an integer is a 400 naming it, on the JSON and binary-tensor paths and through
    ``--workers``; one in range that is no level of the model is the queue's 400, from a
    model with the response cache too (a hit does not skip it)."""
    proc = request.getfixturevalue(server)
    x = np.ones((1, 32), np.float32)
    binary, headers = _binary_request(x, x.nbytes)
    split = int(headers["Inference-Header-Content-Length"])
    doc = json.loads(binary[:split])

    def ask(model, priority, as_binary):
        params = {"priority": priority}
        if as_binary:
            header = json.dumps(doc | {"parameters": doc["parameters"] | params}).encode()
            body = header + x.tobytes()
            sizes = {"Inference-Header-Content-Length": str(len(header))}
            return post(proc, f"/v2/models/{model}/infer", body, sizes)
        return post(proc, f"/v2/models/{model}/infer", infer_json([X], parameters=params))

    models = ["mlp", "cached"] if server == "served" else ["mlp"]
    for model in models:
        for as_binary in (False, True):
            assert ask(model, 1, as_binary).status_code == 200  # (cached: kept, then hits)
            for bad in (2**63, 2**64 - 1, 2**64, -1, 1.5, "1", True):
                r = ask(model, bad, as_binary)
                assert r.status_code == 400, (model, bad, as_binary, r.text)
                assert "parameters.priority must be an integer" in r.json()["error"]
            for no_level in (2, 2**63 - 1):
                r = ask(model, no_level, as_binary)
                assert r.status_code == 400, (model, no_level, as_binary, r.text)
                assert f"priority {no_level} is not a level" in r.json()["error"]


def test_truncated_binary_data(served):
    x = np.ones((2, 32), np.float32)
    body, headers = _binary_request(x, x.nbytes)
    r = post(served, "/v2/models/mlp/infer", body[:-10], headers)
    assert r.status_code == 400 and "truncated binary data" in r.json()["error"]
    r = post(served, "/v2/models/mlp/infer", body, headers)
    assert r.status_code == 200


def test_body_over_the_limit_is_refused(served):
    r = post(served, "/v2/models/mlp/infer", b"0" * (2 << 20))
    assert r.status_code == 413 and "limit" in r.json()["error"]


def test_protocol_errors_count_as_invalid(served):
    before = _metric(served, "pxrt_requests_total", model="mlp", outcome="invalid")
    for body in (b"{not json", infer_json([dict(X, data=[True] * 32)]), infer_json([X], id=[1])):
        assert post(served, "/v2/models/mlp/infer", body).status_code == 400
    after = _metric(served, "pxrt_requests_total", model="mlp", outcome="invalid")
    assert after == before + 3


def test_metrics_page_counts_requests(served):
    before = _metric(served, "pxrt_requests_total", model="mlp", outcome="success")
    for _ in range(3):
        assert post(served, "/v2/models/mlp/infer", infer_json([X])).status_code == 200
    after = _metric(served, "pxrt_requests_total", model="mlp", outcome="success")
    assert after == before + 3
    assert _metric(served, "pxrt_compiles_after_load", model="mlp") == 0
    assert _metric(served, "pxrt_queue_duration_us_count", model="mlp") >= 3


def _metric(served, name, **labels):
    page = httpx.get(served.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{name} {labels} not on the metrics page")


# --------------------------------------------------------------------------- lifecycle


def test_sigterm_under_load_answers_everyone(artifacts):
    proc = ServeProcess([str(artifacts["mlp"])])
    rng = np.random.default_rng(0)
    requests = [
        random_request(MODELS["mlp"]["inputs"], int(rng.integers(1, 6)), rng) for _ in range(400)
    ]
    wants = [reference("mlp", r) for r in requests]
    results: list = [None] * len(requests)

    def worker(k):
        with httpx.Client(timeout=30) as http:
            for i in range(k, len(requests), 8):
                x = requests[i]["x"]
                body, headers = _binary_request(x, x.nbytes)
                try:
                    r = http.post(proc.url + "/v2/models/mlp/infer", content=body, headers=headers)
                    results[i] = r
                except httpx.HTTPError as exc:
                    results[i] = exc

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(r is not None for r in results) < 16 and time.monotonic() < deadline:
        time.sleep(0.01)  # SIGTERM once requests flow, with many still to come
    proc.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(90)
        assert not t.is_alive(), "a client hung"
    assert proc.stop() == 0
    ok = 0
    for r, want in zip(results, wants):
        assert r is not None
        if isinstance(r, httpx.Response) and r.status_code == 200:
            header_len = int(r.headers["inference-header-content-length"])
            doc = json.loads(r.content[:header_len])
            y = np.frombuffer(r.content[header_len:], np.float32).reshape(
                doc["outputs"][0]["shape"]
            )
            assert_matches({"y": y}, want)
            ok += 1
        elif isinstance(r, httpx.Response):
            assert r.status_code == 503, r.text
    assert ok > 0


def test_repeated_sigterm_still_exits_cleanly(artifacts):
    """A second SIGTERM (a supervisor's retry) while the server shuts down does not kill
    it: it still exits 0."""
    proc = ServeProcess([str(artifacts["mlp"])])
    deadline = time.time() + 60
    while proc.proc.poll() is None and time.time() < deadline:
        proc.proc.send_signal(signal.SIGTERM)  # to the very end of the shutdown
        time.sleep(0.002)
    assert proc.proc.wait(5) == 0, proc.output()
    proc.log.close()


def test_not_ready_while_loading_and_503_while_draining(run):
    from serving import Server
    from serving.http.app import create_app

    server = Server(ready=False)
    app = create_app(server)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as http:
            assert (await http.get("/v2/health/live")).status_code == 200
            assert (await http.get("/v2/health/ready")).status_code == 503
            r = await http.post("/v2/models/mlp/infer", content=infer_json([X]))
            assert r.status_code == 503 and "loading" in r.json()["error"]
            server.ready, server.draining = True, True
            assert (await http.get("/v2/health/ready")).status_code == 503
            r = await http.post("/v2/models/mlp/infer", content=infer_json([X]))
            assert r.status_code == 503 and "draining" in r.json()["error"]

    run(main)


def test_queue_full_is_429_with_retry_after(run, models):
    """A full queue answers 429 at once, with Retry-After; the requests it holds succeed."""
    import asyncio

    from models import inject, until

    from serving import Server
    from serving.http.app import create_app

    model = models["mlp"]

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", model, max_queue=2, max_inflight=1, max_batch_size=1)
                transport = httpx.ASGITransport(app=create_app(server))
                async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as http:

                    def post():
                        return asyncio.ensure_future(
                            http.post("/v2/models/mlp/infer", content=infer_json([X]))
                        )

                    first = post()
                    await gate.wait_started()  # one batch on the device, held there
                    queued = [post() for _ in range(2)]  # the queue holds two
                    await until(lambda: server.stats("mlp")["queued_rows"] == 2)
                    refused = await asyncio.gather(*(post() for _ in range(3)))
                    gate.release.set()
                    return [await first, *await asyncio.gather(*queued)], refused

    served_, refused = run(main)
    assert [r.status_code for r in served_] == [200, 200, 200]
    for r in refused:
        assert r.status_code == 429, r.text
        assert "overloaded" in r.json()["error"] and int(r.headers["retry-after"]) >= 1


def test_client_sees_errors_as_exceptions(client):
    inp = triton.InferInput("x", [1, 31], "FP32")
    inp.set_data_from_numpy(np.ones((1, 31), np.float32))
    with pytest.raises(InferenceServerException, match="float32\\[n, 32\\]"):
        client.infer("mlp", [inp])


def test_bench_over_http(served, tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving.cli",
            "bench",
            "--url",
            served.url,
            "--model",
            "mlp",
            "--duration",
            "0.3",
            "--concurrency",
            "1,4",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HTTP binary: 4 clients" in result.stdout
    report = json.loads((out / "bench.json").read_text())
    assert [r["mode"] for r in report["results"]] == ["http-closed", "http-closed", "http-open"]
    assert all(r["requests_per_s"] > 0 and r["errors"] == 0 for r in report["results"])
    assert report["results"][1]["stages_us"]["compute_infer"] > 0


def test_a_client_that_hangs_up_takes_its_request_out_of_the_queue(run, models):
    """Requests of clients that disconnect before their batch is dispatched never run."""
    import asyncio

    import uvicorn
    from models import inject, until
    from servers import free_port

    from serving import Server
    from serving.http.app import create_app

    model = models["mlp"]
    port = free_port()
    body = infer_json([X])
    raw = (
        f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    def waiting_for_disconnect():
        return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith(".receive")]

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", model, max_inflight=1, max_batch_size=1)
                config = uvicorn.Config(
                    create_app(server), port=port, log_level="error", lifespan="off"
                )
                uv = uvicorn.Server(config)
                serving = asyncio.ensure_future(uv.serve())
                await until(lambda: uv.started)
                base_url = f"http://127.0.0.1:{port}"
                async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
                    first = asyncio.ensure_future(http.post("/v2/models/mlp/infer", content=body))
                    await gate.wait_started()  # the first batch is on the device, held
                    writers = []
                    for _ in range(5):  # five clients send a request...
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                        writer.write(raw)
                        await writer.drain()
                        writers.append(writer)
                    await until(lambda: server.stats("mlp")["queued_rows"] == 5)
                    for writer in writers:  # ...and hang up while it waits
                        writer.close()
                    # Under plain uvicorn a pending receive() per request hears the
                    # hang-up (its callback cancels the request's future a turn later);
                    # the first request's is the one left.
                    await until(lambda: len(waiting_for_disconnect()) == 1)
                    await asyncio.sleep(0)
                    gate.release.set()
                    assert (await first).status_code == 200
                uv.should_exit = True
                await serving
                return server.stats("mlp")["requests"], gate.batches

    counts, batches = run(main)
    assert counts["cancelled"] == 5 and counts["success"] == 1, counts
    assert batches == 1  # the hung-up requests never ran


def test_an_unexpected_error_is_a_json_500_on_a_kept_connection(
    run, artifacts, monkeypatch, caplog
):
    """An error nobody planned for: one short log line, a JSON 500 counted as failed, and
    the connection keeps serving."""
    import asyncio
    import logging

    import uvicorn
    from servers import free_port

    import pxrt
    from serving import Server
    from serving.http.app import create_app

    calls = {"n": 0}
    real = codec.encode_response

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("encoder exploded " + "x" * 5000)
        return real(*args, **kwargs)

    monkeypatch.setattr(codec, "encode_response", flaky)
    model = pxrt.load(artifacts["mlp"])
    port = free_port()
    body = infer_json([X])
    one = (
        f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    async def main():
        async with Server() as server:
            server.add_model("mlp", model)
            uv = uvicorn.Server(
                uvicorn.Config(create_app(server), port=port, log_level="error", lifespan="off")
            )
            serving = asyncio.ensure_future(uv.serve())
            while not uv.started:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            replies = []
            for _ in range(2):  # two requests on the same connection
                writer.write(one)
                await writer.drain()
                status = await reader.readline()
                headers = {}
                while (line := await reader.readline()) != b"\r\n":
                    k, v = line.decode().split(":", 1)
                    headers[k.strip().lower()] = v.strip()
                content = await reader.readexactly(int(headers["content-length"]))
                replies.append((status, headers, content))
            writer.close()
            uv.should_exit = True
            await serving
            return replies, server.metrics_snapshot()["mlp"]["requests"]

    with caplog.at_level(logging.ERROR, logger="pxrt.core"):
        (first, second), counts = run(main)
    assert first[0].startswith(b"HTTP/1.1 500") and first[1]["content-type"] == "application/json"
    error = json.loads(first[2])["error"]
    assert "RuntimeError: encoder exploded" in error and len(error) < 300
    assert second[0].startswith(b"HTTP/1.1 200")  # the same connection, still serving
    assert counts["failed"] == 1 and counts["success"] == 2  # it ran; its caller got a 500
    logged = [r for r in caplog.records if r.name.startswith("pxrt.")]
    assert len(logged) == 1 and len(logged[0].getMessage()) < 400


# --------------------------------------------------------------------------- named dims


def test_variable_length_metadata_and_config(client):
    meta = client.get_model_metadata("encoder")
    assert meta["inputs"] == [
        {"name": "tokens", "datatype": "INT32", "shape": [-1, -1]},
        {"name": "mask", "datatype": "BOOL", "shape": [-1, -1]},
    ]
    assert {"name": "hidden", "datatype": "FP32", "shape": [-1, -1, 16]} in meta["outputs"]
    config = client.get_model_config("encoder")
    assert config["input"][0]["dims"] == [-1]
    assert config["parameters"]["dim_buckets.seq"] == {"string_value": "8,16,32"}


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_variable_lengths_over_http_match_jax(client, binary):
    from models import encoder_reference

    rng = np.random.default_rng(5)
    for rows, length in [(1, 1), (2, 8), (1, 9), (3, 31), (2, 32)]:
        request = {
            "tokens": rng.integers(0, 64, (rows, length)).astype(np.int32),
            "mask": rng.random((rows, length)) < 0.8,
        }
        request["mask"][:, 0] = True  # every sequence has a token
        inputs = []
        for k, v in request.items():
            inp = triton.InferInput(k, list(v.shape), codec.datatype_of(v.dtype))
            inp.set_data_from_numpy(v, binary_data=binary)
            inputs.append(inp)
        outputs = [triton.InferRequestedOutput(k, binary_data=binary) for k in ("hidden", "pooled")]
        result = client.infer("encoder", inputs, outputs=outputs)
        got = {k: result.as_numpy(k) for k in ("hidden", "pooled")}
        assert_matches(got, encoder_reference(request), f"rows={rows} L={length}")


def test_a_bad_length_is_a_400_and_the_requests_beside_it_succeed(served):
    good = infer_json(
        [
            {"name": "tokens", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]},
            {"name": "mask", "datatype": "BOOL", "shape": [1, 3], "data": [True, True, False]},
        ]
    )
    bad = infer_json(
        [
            {"name": "tokens", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]},
            {"name": "mask", "datatype": "BOOL", "shape": [1, 2], "data": [True, True]},
        ]
    )
    long = infer_json(
        [
            {"name": "tokens", "datatype": "INT32", "shape": [1, 33], "data": [1] * 33},
            {"name": "mask", "datatype": "BOOL", "shape": [1, 33], "data": [True] * 33},
        ]
    )
    path = "/v2/models/encoder/infer"
    results = {}

    def send(key, body):
        results[key] = post(served, path, body)

    threads = [
        threading.Thread(target=send, args=(k, b))
        for k, b in [("good0", good), ("bad", bad), ("good1", good), ("long", long)]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["good0"].status_code == results["good1"].status_code == 200
    assert results["bad"].status_code == 400
    assert "disagree on dimension 'seq'" in results["bad"].json()["error"]
    assert results["long"].status_code == 400
    assert "dimension 'seq' (axis 1) is 33" in results["long"].json()["error"]


def _encoder_binary(tokens: np.ndarray, mask_bytes: bytes) -> tuple[bytes, dict]:
    shape = list(tokens.shape)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "tokens",
                    "datatype": "INT32",
                    "shape": shape,
                    "parameters": {"binary_data_size": tokens.nbytes},
                },
                {
                    "name": "mask",
                    "datatype": "BOOL",
                    "shape": shape,
                    "parameters": {"binary_data_size": len(mask_bytes)},
                },
            ],
            "outputs": [{"name": "pooled"}],
        }  # fmt: skip
    ).encode()
    body = header + tokens.tobytes() + mask_bytes
    return body, {"Inference-Header-Content-Length": str(len(header))}


def test_bool_bytes_other_than_0_and_1_are_400_and_the_batch_beside_them_succeeds(served):
    tokens = np.arange(1, 9, dtype=np.int32).reshape(1, 8)
    good = bytes([1] * 6 + [0, 0])
    mask = np.frombuffer(good, np.bool_).reshape(1, 8)
    want = encoder_reference({"tokens": tokens, "mask": mask})
    results = {}

    def send(key, mask):
        body, headers = _encoder_binary(tokens, mask)
        results[key] = post(served, "/v2/models/encoder/infer", body, headers)

    cases = [("good0", good), ("two", b"\x01\x02" + good[2:]), ("good1", good),
             ("high", good[:7] + b"\x80"), ("ff", b"\xff" * 8)]  # fmt: skip
    threads = [threading.Thread(target=send, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key in ("good0", "good1"):
        assert results[key].status_code == 200
        out = results[key].json()["outputs"][0]
        got = np.array(out["data"], np.float32).reshape(out["shape"])
        assert_matches({"pooled": got}, {"pooled": want["pooled"]})
    for key, words in [("two", "got 2 at index (0, 1)"), ("high", "got 128 at index (0, 7)"),
                       ("ff", "got 255 at index (0, 0)")]:  # fmt: skip
        r = results[key]
        assert r.status_code == 400, (key, r.text)
        assert "input 'mask': a bool must be the byte 0 or 1" in r.json()["error"]
        assert words in r.json()["error"]
