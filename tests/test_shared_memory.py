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


# --------------------------------------------------------------------------- hardening


def _segment_path(key: str) -> str:
    return os.path.join("/dev/shm", key.lstrip("/"))


def test_a_cached_answer_is_kept_under_the_bytes_that_ran(served, segment):
    """The response cache and a client racing its own region: it asks for ``a`` through
    its region while rewriting it (``a`` or ``b``), so what the server hashed and what
    the batch read could differ; whoever then asks for ``a`` (as JSON, no region) must get
    ``a``'s answer: plain JAX on ``a``, every round."""
    import threading

    client = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
    key, handle = segment(1024)
    name = _name()
    client.register_system_shared_memory(name, key, 1024)
    rng = np.random.default_rng(48)
    try:
        for _ in range(30):
            a, b = rng.standard_normal((2, 1, 32), dtype=np.float32)
            shm.set_shared_memory_region(handle, [a])
            stop = threading.Event()

            def rewrite(a=a, b=b, stop=stop):
                while not stop.is_set():
                    shm.set_shared_memory_region(handle, [b])
                    shm.set_shared_memory_region(handle, [a])

            writer = threading.Thread(target=rewrite)
            writer.start()
            try:
                client.infer("cached", [_x_input(httpclient, name, 128, shape=(1, 32))])
            finally:
                stop.set()
                writer.join()
            asked = httpclient.InferInput("x", [1, 32], "FP32")
            asked.set_data_from_numpy(a, binary_data=False)
            got = client.infer("cached", [asked]).as_numpy("y")
            assert_matches({"y": got}, reference("mlp", {"x": a}))
    finally:
        client.unregister_system_shared_memory(name)
        client.close()


@pytest.fixture(scope="module")
def paired(artifacts, tmp_path_factory):
    """`pxrt serve` with mlp twice: ``pair``, whose batch goes once two rows wait (a
    request waits for its neighbour), and ``mlp``, at once."""
    from servers import ServeProcess

    conf = tmp_path_factory.mktemp("paired") / "serve.toml"
    conf.write_text(
        f'[models.pair]\npath = "{artifacts["mlp"]}"\nmax_batch_size = 2\nmax_delay_us = 60000000\n'
    )
    proc = ServeProcess([str(artifacts["mlp"]), "--config", str(conf), "--allow-client-shm"])
    yield proc
    assert proc.stop() == 0, proc.output()


def _queued(proc, model: str) -> float:
    text = proc.get("/metrics", timeout=10).text
    found = re.search(rf'^pxrt_queued_rows{{model="{model}"[^}}]*}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _until_queued(proc, model: str, rows: int) -> None:
    """Wait (polling the server's gauge: nothing to await from here) until ``rows`` wait."""
    import time

    deadline = time.monotonic() + 60
    while _queued(proc, model) < rows:
        assert time.monotonic() < deadline, f"{rows} rows never waited: {proc.output()[-2000:]}"
        time.sleep(0.01)


def test_a_segment_shrunk_under_a_request_is_a_400_and_its_neighbour_is_answered(paired, segment):
    """A client that shrinks (ftruncate) its segment after registering it, while its
    request waits for its batch (input read, then output written), and while requests
    read it, gets a 400 that names the region: the server stays up (no SIGBUS), and the
    request beside it in the batch is answered as plain JAX."""
    import threading

    client = httpclient.InferenceServerClient(paired.url.removeprefix("http://"), concurrency=2)
    x = np.random.default_rng(4).standard_normal((1, 32), dtype=np.float32)
    neighbour = np.random.default_rng(5).standard_normal((1, 32), dtype=np.float32)
    plain = httpclient.InferInput("x", [1, 32], "FP32")
    plain.set_data_from_numpy(neighbour)
    try:
        # Shrunk between the register and the request: refused at once.
        key, handle = segment(4096)
        name = _name()
        client.register_system_shared_memory(name, key, 4096)
        os.truncate(_segment_path(key), 1024)
        with pytest.raises(InferenceServerException, match=f"'{name}'.*no longer holds"):
            client.infer("mlp", [_x_input(httpclient, name, 128, shape=(1, 32))])

        # Shrunk while the request waits for its neighbour: its input, then its output.
        for where in ("input", "output"):
            key, handle = segment(4096)
            name = _name()
            shm.set_shared_memory_region(handle, [x])
            client.register_system_shared_memory(name, key, 4096)
            if where == "input":
                inputs, outputs = [_x_input(httpclient, name, 128, shape=(1, 32))], None
            else:
                inputs = [httpclient.InferInput("x", [1, 32], "FP32")]
                inputs[0].set_data_from_numpy(x)
                outputs = [httpclient.InferRequestedOutput("y")]
                outputs[0].set_shared_memory(name, 1024, offset=2048)
            shrunk = client.async_infer("pair", inputs, outputs=outputs)
            _until_queued(paired, "pair", 1)
            os.truncate(_segment_path(key), 0)
            answered = client.async_infer("pair", [plain])
            got = answered.get_result().as_numpy("y")
            assert_matches({"y": got}, reference("mlp", {"x": neighbour}))
            with pytest.raises(InferenceServerException) as info:
                shrunk.get_result()
            assert info.value.status() == "400", info.value
            assert ("input 'x'" if where == "input" else "output 'y'") in info.value.message()
            assert f"region '{name}'" in info.value.message() and "shrunk" in info.value.message()
            client.unregister_system_shared_memory(name)

        # Shrunk and grown back over and over while requests read and write it: each is
        # answered or refused by name (a region that broke is registered again).
        key, handle = segment(4096)
        path, stop = _segment_path(key), threading.Event()
        name, refused = _name(), 0
        client.register_system_shared_memory(name, key, 4096)

        def shrink():
            while not stop.is_set():
                os.truncate(path, 0)
                os.truncate(path, 4096)

        shrinker = threading.Thread(target=shrink)
        shrinker.start()
        try:
            for _ in range(60):
                out = httpclient.InferRequestedOutput("y")
                out.set_shared_memory(name, 1024, offset=2048)
                try:
                    client.infer("mlp", [_x_input(httpclient, name, 128, shape=(1, 32))],
                                 outputs=[out])  # fmt: skip
                except InferenceServerException as exc:
                    assert exc.status() == "400" and f"region '{name}'" in exc.message(), exc
                    refused += 1
                    client.unregister_system_shared_memory(name)
                    name = _name()
                    while True:  # (it may be shrunk right now: the register says so)
                        try:
                            client.register_system_shared_memory(name, key, 4096)
                            break
                        except InferenceServerException as again:
                            assert f"region '{name}'" in again.message(), again
        finally:
            stop.set()
            shrinker.join()
        assert paired.proc.poll() is None, paired.output()[-2000:]
        assert paired.get("/v2/health/live").status_code == 200
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_a_read_or_write_of_a_shrunk_mapping_is_refused_by_name(tmp_path, monkeypatch):
    """In process, both ways of reading a region: guarded mappings (the Cython module,
    ``_shmguard``) and, without it, through the descriptor (``_shmguard_py``)."""
    from serving.kserve import _shmguard_py
    from serving.kserve import shm as shm_module

    for guard in ([shm_module._guard, _shmguard_py] if shm_module._guard.PROTECTS else
                  [_shmguard_py]):  # fmt: skip
        monkeypatch.setattr(shm_module, "_guard", guard)
        path = tmp_path / f"segment-{guard.PROTECTS}"
        data = np.arange(4096, dtype=np.float32)
        path.write_bytes(data.tobytes())
        registry = SharedMemory(root=str(tmp_path))
        registry.register("r", "/" + path.name, 0, data.nbytes)
        spec = {"shared_memory_region": "r", "shared_memory_byte_size": 8192}
        x = registry.open.tensor(spec, np.dtype(np.float32), (2048,), "input 'x'")
        placed = registry.open.placed(spec, "output 'y'")
        os.truncate(path, 0)
        if guard.PROTECTS:  # the view reads zeros, the request is refused after it ran
            assert not x[-2048:].any()
            with pytest.raises(RegionError, match="input 'x': shared memory region 'r'"):
                shm_module.check_read({"x": x})
            with pytest.raises(RegionError, match="output 'y': .* 'r'.*shrunk"):
                placed.write("y", np.ones(4, np.float32))
        else:  # read before: the request holds its copy
            np.testing.assert_array_equal(x, data[:2048])
            with pytest.raises(RegionError, match="output 'y': .* 'r'.*shrunk"):
                placed.write("y", np.ones(4, np.float32))
        with pytest.raises(RegionError, match="input 'x': .*'r'.*shrunk"):
            registry.open.tensor(spec, np.dtype(np.float32), (2048,), "input 'x'")
        del x, placed
        registry.close()


def test_pxrt_s_own_segments_and_remote_clients_are_refused(run, artifacts):
    """A --workers server's tensors (any pxrt process's segments) are never a client's
    to register; a client on another host may not register unless the server allows it
    (--allow-remote-shm)."""
    import httpx

    import pxrt
    from serving import Server
    from serving.grpc import native, service
    from serving.http.app import create_app
    from serving.kserve.shm import OWN_PREFIX
    from serving.workers import ipc

    arena = ipc.Arena(4096)
    try:
        assert arena.name.startswith(OWN_PREFIX)
        with pytest.raises(RegionError, match="one of pxrt's own"):
            SharedMemory().register("r", "/" + arena.name, 0, 4096)
    finally:
        arena.close()

    assert [service._local_peer(p) for p in (
        "ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000", "ipv6:[::ffff:127.0.0.1]:1", "unix:",
        "ipv4:10.1.2.3:5000", "ipv6:[2001:db8::1]:5000", "", None,
    )] == [True] * 4 + [False] * 4  # fmt: skip

    class Transport:
        def __init__(self, address):
            self.address = address

        def get_extra_info(self, name):
            return self.address

    assert [service._local_peer(native._peer(Transport(a))) for a in (
        ("127.0.0.1", 1), ("::1", 1, 0, 0), "", ("10.1.2.3", 1), None,
    )] == [True] * 3 + [False] * 2  # fmt: skip

    model = pxrt.load(artifacts["mlp"])
    key = f"/pxrt-test-{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(key[1:], key, 1024)

    async def main():
        for remote in (False, True):
            async with Server(allow_client_shm=True, allow_remote_shm=remote) as server:
                server.add_model("mlp", model)
                for peer, allowed in ((("127.0.0.1", 1), True), (("192.0.2.7", 1), remote)):
                    transport = httpx.ASGITransport(app=create_app(server), client=peer)
                    async with httpx.AsyncClient(transport=transport, base_url="http://p") as h:
                        r = await h.post(
                            "/v2/systemsharedmemory/region/r/register",
                            json={"key": key, "offset": 0, "byte_size": 1024},
                        )
                        if allowed:
                            assert r.status_code == 200, r.text
                            await h.post("/v2/systemsharedmemory/region/r/unregister")
                        else:
                            assert r.status_code == 403, r.text
                            assert "--allow-remote-shm" in r.json()["error"]

    try:
        run(main)
    finally:
        shm.destroy_shared_memory_region(handle)


def test_a_region_belongs_to_the_key_that_registered_it(run, artifacts):
    """Two keys of the ``shared-memory`` group: each has its own region names. The
    second cannot see, use, replace or unregister the first's region (it registers a
    region of the same name: its own), so the first's outputs land in its own segment."""
    import httpx

    import pxrt
    from serving import Server
    from serving.access import Restrictions
    from serving.http.app import create_app

    restrictions = Restrictions.parse(["shared-memory:shm-key=alice", "shared-memory:shm-key=bob"])
    model = pxrt.load(artifacts["mlp"])
    keys = [f"/pxrt-test-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    handles = [shm.create_shared_memory_region(k[1:], k, 4096) for k in keys]
    x = np.random.default_rng(7).standard_normal((1, 32), dtype=np.float32)
    shm.set_shared_memory_region(handles[0], [x])
    alice, bob = {"shm-key": "alice"}, {"shm-key": "bob"}
    request = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "parameters": {
            "shared_memory_region": "out", "shared_memory_byte_size": 128}}],
        "outputs": [{"name": "y", "parameters": {
            "shared_memory_region": "out", "shared_memory_byte_size": 1024,
            "shared_memory_offset": 2048}}],
    }  # fmt: skip

    async def main():
        async with Server(allow_client_shm=True) as server:
            server.add_model("mlp", model)
            app = create_app(server, restrictions=restrictions)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://p") as h:

                async def post(path, headers, **kw):
                    return await h.post("/v2/systemsharedmemory" + path, headers=headers, **kw)

                def register(k):
                    return {"json": {"key": k, "offset": 0, "byte_size": 4096}}

                assert (await post("/region/out/register", alice, **register(keys[0]))).is_success
                # Bob: no such region for him; his unregister is nothing to do.
                r = await h.get("/v2/systemsharedmemory/region/out/status", headers=bob)
                assert r.status_code == 404 and "no shared memory region 'out'" in r.text
                r = await h.post("/v2/models/mlp/infer", json=request, headers=bob)
                assert r.status_code == 404 and "no shared memory region 'out'" in r.text
                assert (await post("/region/out/unregister", bob)).is_success
                assert (await post("/unregister", bob)).is_success
                # ... and his own "out" (his segment), which Alice's requests never reach.
                assert (await post("/region/out/register", bob, **register(keys[1]))).is_success
                r = await h.post("/v2/models/mlp/infer", json=request, headers=alice)
                assert r.status_code == 200, r.text
                for who, k in ((alice, keys[0]), (bob, keys[1])):
                    r = await h.get("/v2/systemsharedmemory/status", headers=who)
                    assert [s["key"] for s in r.json()] == [k]
                assert (await post("/unregister", bob)).is_success
                assert (await h.get("/v2/systemsharedmemory/status", headers=bob)).json() == []
                assert len((await h.get("/v2/systemsharedmemory/status", headers=alice)).json())
                r = await h.post("/v2/models/mlp/infer", json=request)  # no key: 403
                assert r.status_code == 403, r.text

    try:
        run(main)
        y = shm.get_contents_as_numpy(handles[0], np.float32, [1, 32], offset=2048).copy()
        assert_matches({"y": y}, reference("mlp", {"x": x}))
        untouched = shm.get_contents_as_numpy(handles[1], np.uint8, [4096]).copy()
        assert not untouched.any()
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
