"""pxrt inside other inference servers (``serving.integrations``), each started as its
users start it and queried with its own client: answers equal plain JAX's, a bad input
answered in the framework's own error shape while the requests beside it succeed."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import pytest
from models import assert_matches, reference
from servers import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Process:
    """A server process started with ``args``, until ``ready`` (a URL) answers 200."""

    def __init__(
        self, args: list[str], ready: str, env: dict | None = None, program: str = sys.executable
    ) -> None:
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(  # (a group of its own: its workers stop with it)
            [program, *args], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True, env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.output()}")
            try:
                if httpx.get(ready, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not become ready: {self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        """SIGTERM to the server's process group (LitServe's spawned workers too), then
        SIGKILL to what is left of it."""
        group = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        self.proc.wait(30)


def triton_mixed(url: str, *, binary: bool, seed: int, n: int = 48, model: str = "mlp") -> None:
    """tritonclient's async_infer (its own concurrency: a pool of 16 connections), ``n``
    requests to ``model`` (the ``mlp``) with a wrong shape and a wrong dtype sent among
    them: every good answer equals plain JAX's, each bad one is a 400 naming ``x``."""
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    client = triton.InferenceServerClient(url.removeprefix("http://"), concurrency=16)

    def send(x, datatype="FP32"):
        inp = triton.InferInput("x", list(x.shape), datatype)
        inp.set_data_from_numpy(x, binary_data=binary)
        out = triton.InferRequestedOutput("y", binary_data=binary)
        return client.async_infer(model, [inp], outputs=[out])

    rng = np.random.default_rng(seed)
    good = [rng.standard_normal((1 + i % 4, 32)).astype(np.float32) for i in range(n)]
    bad = [
        (np.ones((2, 31), np.float32), "FP32", r"x.*float32\[n, 32\]"),
        (np.ones((2, 32), np.float64), "FP64", r"x.*float32"),
    ]
    sent = [send(x) for x in good[: n // 2]]
    errors = [send(x, d) for x, d, _ in bad]
    sent += [send(x) for x in good[n // 2 :]]
    try:
        for x, handle in zip(good, sent):
            y = handle.get_result(timeout=60).as_numpy("y")
            assert_matches({"y": y}, reference("mlp", {"x": x}))
        for (_, _, words), handle in zip(bad, errors):
            with pytest.raises(InferenceServerException, match=words) as got:
                handle.get_result(timeout=60)
            assert got.value.status() == "400", got.value
    finally:
        client.close()


@pytest.fixture(scope="module")
def kserve_server(artifacts):
    pytest.importorskip("kserve")
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    args = ["tests/kserve_app.py", "mlp", str(artifacts["mlp"]), "--http_port", str(port)]
    proc = Process([*args, "--enable_grpc", "false"], f"{url}/v2/models/mlp/ready")
    proc.url = url
    yield proc
    proc.stop()


@pytest.mark.parametrize("model", ["mlp", "mlp-kserve"])
def test_kserve_serves_a_pxrt_model_batched_by_pxrt(kserve_server, model):
    """KServe's own InferenceRESTClient and tritonclient, JSON and binary tensors, many
    callers at once; a bad dtype and a bad shape are KServe's 400s naming the input,
    and the requests sent beside them are answered. ``mlp``: REST inference answered by
    pxrt's own v2 endpoint (the default); ``mlp-kserve``: through KServe's predict."""
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    url = kserve_server.url
    meta = httpx.get(f"{url}/v2/models/{model}", timeout=10).json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 32]}], meta
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 32]}], meta
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((n, 32)).astype(np.float32) for n in (1, 3, 7)]

    async def kserve_client():
        client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0))
        try:
            for i, x in enumerate(xs):
                inp = InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x, binary_data=bool(i % 2))
                request = InferRequest(model, [inp], request_id=f"r{i}")
                result = await client.infer(url, request, model)
                assert result.id == f"r{i}"
                got = {o.name: o.as_numpy() for o in result.outputs}
                assert_matches(got, reference("mlp", {"x": x}), f"kserve client, request {i}")
        finally:
            await client.close()

    asyncio.run(kserve_client())

    triton_mixed(url, binary=True, seed=5, model=model)


@pytest.fixture(scope="module")
def litserve_server(artifacts):
    if importlib.util.find_spec("litserve") is None:  # (not imported here: its server is)
        pytest.skip("litserve is not installed (the test extra has it)")
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    proc = Process(["tests/litserve_app.py", str(artifacts["mlp"]), str(port)], f"{url}/health")
    proc.url = url
    yield proc
    proc.stop()


def test_litserve_serves_a_pxrt_model_batched_by_pxrt(litserve_server):
    """LitServe's /predict, 40 requests in flight at once with bad ones among them:
    every good answer equals plain JAX's; a wrong shape, an unknown input and values
    that are not numbers are LitServe's 400s naming the input."""
    url = f"{litserve_server.url}/predict"
    rng = np.random.default_rng(6)
    good = [rng.standard_normal((1 + i % 4, 32)).astype(np.float32) for i in range(40)]
    bad = [
        ({"inputs": {"x": [[1.0] * 31]}}, r"x.*float32\[n, 32\]"),
        ({"inputs": {"z": [[1.0] * 32]}}, "'z'"),
        ({"inputs": {"x": [["a"] * 32]}}, "input 'x': not rows of float32"),
    ]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            bodies = [{"inputs": {"x": x.tolist()}} for x in good[:20]]
            bodies += [body for body, _ in bad] + [{"inputs": {"x": x.tolist()}} for x in good[20:]]
            return await asyncio.gather(*(client.post(url, json=b) for b in bodies))

    answers = asyncio.run(main())
    errors = answers[20 : 20 + len(bad)]
    answers = answers[:20] + answers[20 + len(bad) :]
    for x, r in zip(good, answers):
        assert r.status_code == 200, r.text
        y = np.asarray(r.json()["outputs"]["y"], np.float32)
        assert_matches({"y": y}, reference("mlp", {"x": x}))
    for (_, words), r in zip(bad, errors):
        assert r.status_code == 400, r.text
        assert re.search(words, r.json()["detail"]), r.text


@pytest.fixture(scope="module")
def bentoml_server(artifacts):
    if importlib.util.find_spec("bentoml") is None:  # (not imported here: its server is)
        pytest.skip("bentoml is not installed (the test extra has it)")
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "bentoml", "serve", "bentoml_app:MLP", "--working-dir", "tests"]
    env = {"PXRT_TEST_ARTIFACT": str(artifacts["mlp"])}
    proc = Process([*args, "--port", str(port)], f"{url}/readyz", env)
    proc.url = url
    yield proc
    proc.stop()


def test_bentoml_serves_a_pxrt_model_batched_by_pxrt(bentoml_server):
    """BentoML's own client (``AsyncHTTPClient``, its typed numpy fields), 40 requests
    in flight at once with bad ones among them: every good answer equals plain JAX's; a
    wrong shape is BentoML's InvalidArgument naming the input, values that are not
    numbers its validation error naming the field."""
    import bentoml

    url = bentoml_server.url
    rng = np.random.default_rng(7)
    good = [rng.standard_normal((1 + i % 4, 32)).astype(np.float32) for i in range(40)]
    bad = [
        ({"x": [[1.0] * 31]}, r"input 'x'.*float32\[n, 32\]"),
        ({"x": [["a"] * 32]}, r"'loc': \['x'\]"),
    ]

    async def main():
        async with bentoml.AsyncHTTPClient(url) as client, httpx.AsyncClient() as plain:
            sent = [client.predict(x=x) for x in good[:20]]
            sent += [plain.post(f"{url}/predict", json=body, timeout=60) for body, _ in bad]
            sent += [client.predict(x=x) for x in good[20:]]
            return await asyncio.gather(*sent)

    answers = asyncio.run(main())
    errors = answers[20 : 20 + len(bad)]
    answers = answers[:20] + answers[20 + len(bad) :]
    for x, got in zip(good, answers):
        assert_matches({"y": np.asarray(got["y"], np.float32)}, reference("mlp", {"x": x}))
    for (_, words), r in zip(bad, errors):
        assert r.status_code == 400, r.text
        assert re.search(words, str(r.json())), r.text


def test_bentoml_mounts_pxrts_v2_endpoint_on_the_same_model(bentoml_server):
    """The service's /v2 mount is pxrt's KServe v2 app in BentoML's worker: its
    metadata, and tritonclient with binary tensors, a bad shape and a bad dtype among
    the requests (400s naming x, the rest answered as plain JAX answers them)."""
    url = bentoml_server.url
    meta = httpx.get(f"{url}/v2/models/mlp", timeout=10).json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 32]}], meta
    triton_mixed(url, binary=True, n=16, seed=9)


MLSERVER_PYTHON = os.path.join(ROOT, ".venv-mlserver", "bin", "python")


@pytest.fixture(scope="module")
def mlserver_server(artifacts, tmp_path_factory):
    """``mlserver start`` over a model folder whose settings name ``PxrtRuntime``, from
    the venv ``make`` builds for MLServer (it cannot share this one: see pyproject.toml)."""
    if not os.path.exists(MLSERVER_PYTHON):
        pytest.skip("no .venv-mlserver: `make` builds it (MLServer's pins need a venv of its own)")
    import json

    root = tmp_path_factory.mktemp("mlserver")
    for name, native in (("mlp", True), ("mlp-mlserver", False)):
        (root / name).mkdir()
        extra = {"batching": {"max_delay_us": 2000}, "native_v2": native}
        settings = {
            "name": name,
            "implementation": "serving.integrations.mlserver.PxrtRuntime",
            "parameters": {"uri": str(artifacts["mlp"]), "extra": extra},
        }
        (root / name / "model-settings.json").write_text(json.dumps(settings))
    http, grpc, metrics = free_ports(3)
    ports = {"http_port": http, "grpc_port": grpc, "metrics_port": metrics}
    # (no inference worker process: pxrt batches on MLServer's own loop, as its docs say)
    (root / "settings.json").write_text(json.dumps({**ports, "parallel_workers": 0}))
    url = f"http://127.0.0.1:{http}"
    env = {"PYTHONPATH": ROOT}  # (what `pip install 'pxrt[mlserver]'` would put in its venv)
    mlserver = os.path.join(os.path.dirname(MLSERVER_PYTHON), "mlserver")
    proc = Process(["start", str(root)], f"{url}/v2/health/ready", env, program=mlserver)
    proc.url = url
    yield proc
    proc.stop()


@pytest.mark.parametrize("model", ["mlp", "mlp-mlserver"])
def test_mlserver_serves_a_pxrt_model_batched_by_pxrt(mlserver_server, model):
    """tritonclient (MLServer's own dependency, its v2 client) over MLServer's REST, 48
    requests in flight at once with bad ones among them: every answer equals plain
    JAX's, a wrong datatype and a wrong shape are MLServer's 400s naming the input; the
    metadata lists the artifact's tensors. ``mlp``: REST inference answered by pxrt's
    own v2 endpoint (the default), binary tensors too; ``mlp-mlserver``: through
    MLServer's ``predict`` (its REST reads JSON tensors only)."""
    url = mlserver_server.url
    meta = httpx.get(f"{url}/v2/models/{model}", timeout=10).json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 32]}], meta
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 32]}], meta
    native = model == "mlp"
    triton_mixed(url, binary=native, seed=8, model=model, n=48 if native else 24)


def test_mlserver_unloads_a_pxrt_model_and_its_native_routes(mlserver_server):
    """Unloaded through MLServer's repository API, the native model's routes go with
    it: its inference is MLServer's 404 again, while the other model still answers."""
    url = mlserver_server.url
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0.5] * 32}]}
    assert httpx.post(f"{url}/v2/models/mlp/infer", json=body, timeout=30).status_code == 200
    assert httpx.post(f"{url}/v2/repository/models/mlp/unload", timeout=60).status_code == 200
    gone = httpx.post(f"{url}/v2/models/mlp/infer", json=body, timeout=30)
    assert gone.status_code == 404 and "mlp" in gone.json()["error"], gone.text
    other = httpx.post(f"{url}/v2/models/mlp-mlserver/infer", json=body, timeout=30)
    assert other.status_code == 200, other.text


def test_loading_freezes_the_collector_unless_told_not_to(artifacts, monkeypatch):
    """KServe's and LitServe's loads end as ``pxrt serve``'s start does, with the
    garbage collector frozen (``serve.refreeze_gc``); ``freeze_gc=False`` leaves it."""
    pytest.importorskip("kserve")
    pytest.importorskip("litserve")
    import serving.serve
    from serving.integrations.kserve import PxrtModel
    from serving.integrations.litserve import PxrtLitAPI

    calls: list[str] = []
    monkeypatch.setattr(serving.serve, "refreeze_gc", lambda: calls.append("frozen"))
    path = str(artifacts["mlp"])
    for freeze in (True, False):
        model = PxrtModel("mlp", path, native_v2=False, freeze_gc=freeze)
        model.load()
        model.stop()
        PxrtLitAPI(path, freeze_gc=freeze).setup("cpu")
    assert calls == ["frozen", "frozen"]
