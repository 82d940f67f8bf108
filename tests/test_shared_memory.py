"""System shared memory (Triton's extension) with the unmodified Triton clients: inputs
read from a region and outputs written to one equal plain JAX on every front end (native
and ASGI HTTP, native and grpcio gRPC); bad regions are refused by name and the server
goes on; a region never outlives its unregister, and a shrunk segment is a 400, not a
crash. The restricted API group ``shared-memory`` is in test_access.py, ``--workers``
in test_workers.py."""

from __future__ import annotations

import gc
import os
import re
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from models import MODELS, assert_matches, random_request, reference
from tritonclient.utils import InferenceServerException

from serving.kserve import codec
from serving.kserve.shm import RegionError, SharedMemory

FRONT_ENDS = ["http", "http-asgi", "grpc", "grpcio"]


@pytest.fixture(params=FRONT_ENDS)
def front(request):
    """(client module, client) for each front end of the session's servers."""
    kind = request.param
    served = request.getfixturevalue(
        {"http": "served", "http-asgi": "served_asgi", "grpc": "served", "grpcio": "served_grpcio"}[
            kind
        ]
    )
    if kind.startswith("http"):
        client = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
        yield httpclient, client
    else:
        client = grpcclient.InferenceServerClient(served.grpc_url)
        yield grpcclient, client
    client.close()


@pytest.fixture
def segment():
    """A fresh shared memory segment of 4 KiB (``create(size)`` for others), destroyed
    after the test."""
    made = []

    def create(size=4096):
        key = f"/pxrt-test-{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key[1:], key, size)
        made.append(handle)
        return key, handle

    yield create
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _name() -> str:
    return f"region-{uuid.uuid4().hex[:10]}"


def test_tensors_in_shared_memory_equal_jax_on_every_front_end(front, segment):
    """``two_io``: ``tokens`` from a region, ``features`` in the request; ``scores`` written
    to a region at an offset, ``argmax`` in the answer."""
    module, client = front
    request = random_request(MODELS["two_io"]["inputs"], 3, np.random.default_rng(21))
    expected = reference("two_io", request)
    key, handle = segment()
    name = _name()
    client.register_system_shared_memory(name, key, 4096)
    try:
        tokens = request["tokens"]
        shm.set_shared_memory_region(handle, [tokens], offset=64)
        inputs = [
            module.InferInput("tokens", list(tokens.shape), "INT32"),
            module.InferInput("features", list(request["features"].shape), "FP16"),
        ]
        inputs[0].set_shared_memory(name, tokens.nbytes, offset=64)
        inputs[1].set_data_from_numpy(request["features"])
        scores = expected["scores"]
        outputs = [module.InferRequestedOutput("scores"), module.InferRequestedOutput("argmax")]
        outputs[0].set_shared_memory(name, scores.nbytes, offset=1024)
        result = client.infer("two_io", inputs, outputs=outputs)
        got = shm.get_contents_as_numpy(handle, scores.dtype, list(scores.shape), offset=1024)
        assert_matches({"scores": got, "argmax": result.as_numpy("argmax")}, expected)
        # Described as Triton describes it: name, datatype and shape, no data.
        described = result.get_output("scores")
        if module is httpclient:
            assert described == {"name": "scores", "datatype": "FP32", "shape": [3, 3]}
        else:
            assert list(described.shape) == [3, 3] and not described.parameters
            assert result.get_response().raw_output_contents[0] == b""

        status = client.get_system_shared_memory_status(name)
        if module is grpcclient:
            status = [
                {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in status.regions.values()
            ]
        assert status == [{"name": name, "key": key, "offset": 0, "byte_size": 4096}]
    finally:
        client.unregister_system_shared_memory(name)
    # Gone for every request after the unregister: a 400 that names it.
    for call in (lambda: client.infer("two_io", inputs),
                 lambda: client.get_system_shared_memory_status(name)):  # fmt: skip
        with pytest.raises(InferenceServerException) as info:
            call()
        assert f"no shared memory region '{name}'" in info.value.message()
        assert info.value.status() in ("404", "StatusCode.NOT_FOUND")  # (as Triton's)
    client.unregister_system_shared_memory(name)  # again: nothing to do, not an error


def _x_input(module, name, size, offset=0, shape=(2, 32)):
    x = module.InferInput("x", list(shape), "FP32")
    x.set_shared_memory(name, size, offset=offset)
    return x


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_bad_regions_are_refused_by_name_and_the_server_goes_on(kind, served, segment):
    module = httpclient if kind == "http" else grpcclient
    client = (
        httpclient.InferenceServerClient(served.url.removeprefix("http://"))
        if kind == "http"
        else grpcclient.InferenceServerClient(served.grpc_url)
    )
    key, handle = segment(1024)
    name = _name()
    good = np.arange(64, dtype=np.float32).reshape(2, 32) / 64
    shm.set_shared_memory_region(handle, [good])
    expected = reference("mlp", {"x": good})
    try:
        for args, message in [
            ((name, "/pxrt-no-such-segment", 64), "cannot open shared memory segment"),
            ((name, "/../etc/passwd", 64), "key must name a shared memory segment"),
            ((name, key, 2048), "has 1024 bytes; offset 0 + byte_size 2048 goes past its end"),
        ]:
            with pytest.raises(InferenceServerException, match=re.escape(message)):
                client.register_system_shared_memory(*args)
        client.register_system_shared_memory(name, key, 512)
        with pytest.raises(InferenceServerException, match="already registered"):
            client.register_system_shared_memory(name, key, 512)
        for x, message in [
            (_x_input(module, "nope", 256), "input 'x': no shared memory region 'nope'"),
            (_x_input(module, name, 256, offset=384), "bytes 384..640 are outside"),
            (_x_input(module, name, 252), "needs 256 bytes, shared_memory_byte_size says 252"),
        ]:
            with pytest.raises(InferenceServerException, match=re.escape(message)):
                client.infer("mlp", [x])
        small = module.InferRequestedOutput("y")
        small.set_shared_memory(name, 8, offset=256)
        with pytest.raises(InferenceServerException, match="output 'y': the output has"):
            client.infer("mlp", [_x_input(module, name, 256)], outputs=[small])
        # CUDA shared memory is not served: none listed, unregistering all succeeds (as
        # perf_analyzer does at start and exit), a register is refused by name.
        client.unregister_cuda_shared_memory()
        cuda = client.get_cuda_shared_memory_status()
        assert (cuda == []) if module is httpclient else not cuda.regions
        with pytest.raises(InferenceServerException, match="cannot be registered: pxrt serves"):
            client.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 64)
        # The server goes on: the region serves a good request.
        got = client.infer("mlp", [_x_input(module, name, 256)]).as_numpy("y")
        assert_matches({"y": got}, expected)
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_a_region_outlives_no_unregister_and_a_shrunk_segment_is_refused(tmp_path):
    """In process: views a request took keep their mapping alive past the unregister
    (no crash, the bytes still read), new uses are refused; a segment shrunk below the
    window is a 400 at its next use, not a SIGBUS."""
    path = tmp_path / "segment"
    data = np.arange(256, dtype=np.float32)
    path.write_bytes(data.tobytes())
    registry = SharedMemory(root=str(tmp_path))
    registry.register("r", "/segment", 128, 512)
    regions = registry.open
    view = regions.tensor(
        {"shared_memory_region": "r", "shared_memory_byte_size": 256}, np.dtype(np.float32),
        (64,), "input 'x'",
    )  # fmt: skip
    np.testing.assert_array_equal(view, data[32:96])
    placed = regions.placed({"shared_memory_region": "r", "shared_memory_byte_size": 16}, "y")
    registry.unregister("r")
    np.testing.assert_array_equal(view, data[32:96])  # still mapped for its holder
    with pytest.raises(RegionError, match="'r' was unregistered while the request ran"):
        placed.write("y", np.zeros(4, np.float32))
    with pytest.raises(RegionError, match="no shared memory region 'r'"):
        regions.region("r", "input 'x'")
    del view, placed
    gc.collect()

    registry.register("r", "/segment", 0, 1024)
    os.truncate(path, 512)
    spec = {"shared_memory_region": "r", "shared_memory_byte_size": 16}
    with pytest.raises(RegionError, match="no longer holds bytes 0..1024"):
        regions.tensor(spec, np.dtype(np.float32), (4,), "input 'x'")
    registry.close()
    assert registry.status() == []


def test_shared_memory_parameters_are_checked_in_the_codec():
    doc = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0.0] * 32,
             "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 128}},
        ]
    }  # fmt: skip
    with pytest.raises(codec.ProtocolError, match="names a shared memory region and also has"):
        codec.decode_inputs(doc, memoryview(b""), None, SharedMemory().open)
    del doc["inputs"][0]["data"]
    with pytest.raises(codec.ProtocolError, match="does not serve system shared memory"):
        codec.decode_inputs(doc, memoryview(b""), None, None)
    doc["inputs"][0]["parameters"]["shared_memory_byte_size"] = -1
    registry = SharedMemory(unavailable="not here: --workers")
    with pytest.raises(RegionError, match="not here: --workers"):
        codec.decode_inputs(doc, memoryview(b""), None, registry.open)
