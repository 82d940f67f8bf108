"""pxrt replicas on Ray Serve (`serving.ray`), on a local Ray started by the test: the
unmodified Triton HTTP client through Ray's proxy and the handle API against JAX, errors
and their status codes, and a replica killed under load."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import warnings

import httpx
import numpy as np
import pytest

# Ray's own modules warn of their deprecations (at import, and in its calls): not
# pxrt's to fix.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    from ray import serve

    from serving.ray import PxrtHandle, pxrt_app

import tritonclient.http as httpclient  # noqa: E402
from models import MODELS, assert_matches, random_request, reference  # noqa: E402
from servers import free_ports  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from serving import Overloaded  # noqa: E402
from serving.kserve.codec import datatype_of  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray (2 CPUs) with Serve's HTTP proxy on a free port."""
    (port,) = free_ports(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def mlp(cluster, artifacts):
    """The test MLP on 2 replicas (half a CPU each), at the proxy's root."""
    app = pxrt_app(
        str(artifacts["mlp"]),
        num_replicas=2,
        ray_actor_options={"num_cpus": 0.5},
        max_delay_us=1000,
    )
    handle = serve.run(app, name="mlp", route_prefix="/")
    return cluster, handle


def _pids(handle, want=2, within_s=30.0):
    """The pids of the replicas that answer (many calls at once: Ray's router spreads
    them; it learns of new replicas a moment after they start)."""
    pids: set[int] = set()
    deadline = time.time() + within_s
    while len(pids) < want and time.time() < deadline:
        calls = [handle.metrics.remote() for _ in range(32)]
        pids |= {c.result()["pid"] for c in calls}
        time.sleep(0.2)
    return pids


def test_handle_answers_match_jax_on_both_replicas(mlp):
    _, handle = mlp
    rng = np.random.default_rng(0)
    requests = [random_request(MODELS["mlp"]["inputs"], 1 + i % 5, rng) for i in range(40)]
    responses = [handle.infer.remote(r) for r in requests]  # all in flight at once
    for request, response in zip(requests, responses):
        assert_matches(response.result(), reference("mlp", request))
    assert len(_pids(handle)) == 2  # both replicas serve
    assert handle.metadata.remote().result()["inputs"][0]["shape"] == [-1, 32]


def test_a_bad_request_fails_alone_through_the_handle(mlp):
    _, handle = mlp
    rng = np.random.default_rng(1)
    good = [random_request(MODELS["mlp"]["inputs"], 2, rng) for _ in range(10)]
    bad = {"x": np.ones((2, 31), np.float32)}
    responses = [handle.infer.remote(r) for r in good[:5] + [bad] + good[5:]]
    with pytest.raises(ValueError, match="input 'x': expected shape float32\\[n, 32\\]"):
        responses[5].result()
    for request, response in zip(good, responses[:5] + responses[6:]):
        assert_matches(response.result(), reference("mlp", request))


def test_pxrt_handle_coalesces_calls_and_fails_each_request_alone(mlp):
    _, handle = mlp
    calls = []

    class Counting:  # the deployment's handle, counting the Ray calls made
        class infer_many:  # noqa: N801 - as on a DeploymentHandle
            @staticmethod
            def remote(requests, *args, **kwargs):
                calls.append(len(requests))
                return handle.infer_many.remote(requests, *args, **kwargs)

    rng = np.random.default_rng(4)
    requests = [random_request(MODELS["mlp"]["inputs"], 1 + i % 3, rng) for i in range(60)]
    requests[13] = {"x": np.ones((1, 32), np.int32)}  # the wrong dtype
    requests[40] = {"y": np.ones((1, 32), np.float32)}  # the wrong input name

    async def main():
        h = PxrtHandle(Counting, max_inflight=2)
        return await asyncio.gather(*(h.infer(r) for r in requests), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[13], TypeError) and "input 'x'" in str(results[13])
    assert isinstance(results[40], ValueError) and "'y'" in str(results[40])
    for i, (request, result) in enumerate(zip(requests, results)):
        if i not in (13, 40):
            assert_matches(result, reference("mlp", request))
    assert sum(calls) == 60 and len(calls) < 10, calls  # few Ray calls for 60 requests


def test_the_triton_http_client_through_rays_proxy(mlp):
    url, _ = mlp
    client = httpclient.InferenceServerClient(url, concurrency=8)
    assert client.is_server_ready() and client.is_model_ready("mlp")
    assert client.get_model_metadata("mlp")["inputs"][0]["datatype"] == "FP32"
    rng = np.random.default_rng(2)
    pending = []
    for i in range(16):
        request = random_request(MODELS["mlp"]["inputs"], 1 + i % 4, rng)
        x = request["x"] if i != 7 else np.ones((3, 30), np.float32)  # one bad request
        inp = httpclient.InferInput("x", list(x.shape), datatype_of(x.dtype))
        inp.set_data_from_numpy(x, binary_data=i % 2 == 0)
        pending.append((request, client.async_infer("mlp", [inp])))
    for i, (request, call) in enumerate(pending):
        if i == 7:
            with pytest.raises(InferenceServerException) as info:
                call.get_result()
            assert info.value.status() == "400" and "input 'x'" in info.value.message()
        else:
            assert_matches({"y": call.get_result().as_numpy("y")}, reference("mlp", request))
    client.close()


def test_a_full_queue_is_overloaded_over_http_and_the_handle(cluster, artifacts):
    app = pxrt_app(
        str(artifacts["mlp"]), num_replicas=1, ray_actor_options={"num_cpus": 0.5},
        max_queue=1, max_delay_us=200_000, max_ongoing_requests=64,
    )  # fmt: skip
    # (with max_ongoing_requests at its default, max_queue, Ray would hold the extra
    # requests in its own queue and hand the replica one at a time)
    handle = serve.run(app, name="tiny", route_prefix="/tiny")
    x = np.ones((1, 32), np.float32)
    responses = [handle.infer.remote({"x": x}) for _ in range(20)]
    outcomes = []
    for r in responses:
        try:
            r.result()
            outcomes.append("ok")
        except Overloaded as exc:  # Ray's RayTaskError(Overloaded) is one
            assert exc.retry_after_s > 0
            outcomes.append("overloaded")
    assert "ok" in outcomes and "overloaded" in outcomes
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0.0] * 32}]}
    with httpx.Client(base_url=f"http://{cluster}/tiny", timeout=30) as http:
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(http.post("/v2/models/mlp/infer",
                                                                      json=body)))
            for _ in range(12)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    codes = sorted(r.status_code for r in results)
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    assert all(r.headers["retry-after"] for r in results if r.status_code == 429)
    serve.delete("tiny")


def test_a_killed_replica_loses_no_request_and_is_replaced(mlp):
    _, handle = mlp
    before = _pids(handle)
    assert len(before) == 2
    rng = np.random.default_rng(3)
    requests = [random_request(MODELS["mlp"]["inputs"], 2, rng) for _ in range(8)]
    wants = [reference("mlp", r) for r in requests]
    outcomes = {"ok": 0, "failed": 0}
    wrong = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(k):
        i = k
        while not stop.is_set():
            j = i % len(requests)
            try:
                got = handle.infer.remote(requests[j]).result(timeout_s=60)
            except (ray.exceptions.RayError, ray.serve.exceptions.RayServeException):
                with lock:
                    outcomes["failed"] += 1  # reported failed by Ray: not lost
            else:
                with lock:
                    outcomes["ok"] += 1
                if not all(np.allclose(got[n], wants[j][n], rtol=1e-5, atol=1e-5) for n in got):
                    wrong.append(j)
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    time.sleep(2)
    os.kill(sorted(before)[0], signal.SIGKILL)
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join(90)
    # Every call came back (none hung): answered right, or failed by Ray's report.
    assert not any(t.is_alive() for t in threads)
    assert not wrong and outcomes["ok"] > 0, outcomes
    # Ray replaces the replica: two serve again, one of them new.
    deadline = time.time() + 120
    while time.time() < deadline:
        status = serve.status().applications["mlp"]
        if status.status == "RUNNING":
            pids = _pids(handle)
            if len(pids) == 2 and pids != before:
                break
        time.sleep(1)
    else:
        pytest.fail(f"the deployment did not recover: {serve.status().applications['mlp']}")
    x = random_request(MODELS["mlp"]["inputs"], 3, rng)
    assert_matches(handle.infer.remote(x).result(), reference("mlp", x))
