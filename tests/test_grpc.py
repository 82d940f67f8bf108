"""`pxrt serve --grpc-port` driven by the unmodified Triton gRPC clients (sync and asyncio)."""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import shutil
import socket
import sys
import time

import pytest

if "kserve" in sys.modules:  # its protobufs claim the same names as tritonclient.grpc's
    pytest.skip(
        "kserve is imported in this process; run the gRPC tests in their own pytest "
        "(make test does: pytest tests/test_grpc.py)",
        allow_module_level=True,
    )

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from models import (
    ENCODER_SIZES,
    MODELS,
    assert_matches,
    encoder_reference,
    inject,
    random_request,
    reference,
    until,
)
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

import pxrt
from serving.kserve import codec

OUTPUTS = {
    "mlp": ["y"],
    "two_io": ["argmax", "scores"],
    "bf16": ["output"],
    "all_dtypes": ["bf16", "f16", "f32", "flag", "i32", "i64", "u8"],
}


@pytest.fixture(params=["native", "grpcio"])
def grpc_served(request):
    """``pxrt serve`` with gRPC on pxrt's HTTP/2 (the default), and with grpcio's server
    (``--no-native-grpc``): both held to the same answers."""
    return request.getfixturevalue("served" if request.param == "native" else "served_grpcio")


@pytest.fixture
def client(grpc_served):
    c = grpcclient.InferenceServerClient(grpc_served.grpc_url)
    yield c
    c.close()


def _inputs(request):
    inputs = []
    for k, v in request.items():
        inp = grpcclient.InferInput(k, list(v.shape), codec.datatype_of(v.dtype))
        inp.set_data_from_numpy(np.ascontiguousarray(v))
        inputs.append(inp)
    return inputs


def _status(call):
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status(), info.value.message()


def test_health_metadata_config_statistics(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp") and not client.is_model_ready("nope")
    assert not client.is_model_ready("mlp", model_version="7")
    assert "binary_tensor_data" in client.get_server_metadata(as_json=True)["extensions"]
    meta = client.get_model_metadata("two_io", as_json=True)
    assert meta["inputs"][1] == {"name": "features", "datatype": "FP16", "shape": ["-1", "8"]}
    enc = client.get_model_metadata("encoder", as_json=True)
    assert enc["inputs"][0]["shape"] == ["-1", "-1"]
    config = client.get_model_config("two_io", as_json=True)["config"]
    assert config["max_batch_size"] == 8 and config["input"][1]["data_type"] == "TYPE_FP16"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "2000"
    client.infer("mlp", _inputs({"x": np.ones((1, 32), np.float32)}))
    stats = client.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) >= 1
    everyone = client.get_inference_statistics(as_json=True)["model_stats"]
    assert {s["name"] for s in everyone} >= {"mlp", "two_io", "encoder"}


def test_the_response_cache_over_grpc(client):
    """The session server's ``cached`` model (``response_cache = {enable = true}``):
    a repeat is answered like the first, and Triton's statistics count it."""

    def counts():
        stats = client.get_inference_statistics("cached", as_json=True)["model_stats"][0]
        stats = stats["inference_stats"]
        return (int(stats.get("cache_hit", {}).get("count", 0)),
                int(stats.get("cache_miss", {}).get("count", 0)))  # fmt: skip

    request = random_request(MODELS["mlp"]["inputs"], 3, np.random.default_rng(11))
    before = counts()
    for _ in range(3):
        got = client.infer("cached", _inputs(request)).as_numpy("y")
        assert_matches({"y": got}, reference("mlp", request))
    assert counts() == (before[0] + 2, before[1] + 1)
    config = client.get_model_config("cached", as_json=True)["config"]
    assert config["response_cache"] == {"enable": True}


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_raw_inference_matches_jax(client, name):
    rng = np.random.default_rng(len(name))
    for rows in (1, 3, 2 * MODELS[name]["buckets"][-1] + 1):
        request = random_request(MODELS[name]["inputs"], rows, rng)
        result = client.infer(name, _inputs(request), request_id=f"r{rows}")
        assert result.get_response().id == f"r{rows}"
        got = {k: result.as_numpy(k) for k in OUTPUTS[name]}
        assert_matches(got, reference(name, request), f"{name} rows={rows}")


def test_variable_lengths_match_jax(client):
    rng = np.random.default_rng(9)
    for rows, length in [(1, 1), (2, 17), (3, 32)]:
        request = {
            "tokens": rng.integers(0, ENCODER_SIZES["vocab"], (rows, length)).astype(np.int32),
            "mask": np.ones((rows, length), bool),
        }
        result = client.infer("encoder", _inputs(request))
        got = {k: result.as_numpy(k) for k in ("hidden", "pooled")}
        assert_matches(got, encoder_reference(request), f"L={length}")


def test_typed_contents_and_requested_outputs(grpc_served):
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.insecure_channel(grpc_served.grpc_url)
    infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
    x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
    request = pb.ModelInferRequest(model_name="mlp", id="typed")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 32])
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    request.outputs.add(name="y")
    response = infer(request)
    y = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 32)
    assert response.id == "typed" and list(response.outputs[0].shape) == [2, 32]
    assert_matches({"y": y}, reference("mlp", {"x": x}))

    def code_of(req):
        with pytest.raises(grpc.RpcError) as info:
            infer(req)
        return info.value.code(), info.value.details()

    both = pb.ModelInferRequest(model_name="mlp")
    t = both.inputs.add(name="x", datatype="FP32", shape=[1, 32])
    t.contents.fp32_contents.extend([1.0] * 32)
    both.raw_input_contents.append(np.ones((1, 32), np.float32).tobytes())
    code, details = code_of(both)  # as Triton: one or the other
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "both contents and raw" in details
    wrong = pb.ModelInferRequest(model_name="two_io")
    t = wrong.inputs.add(name="features", datatype="FP16", shape=[1, 8])
    code, details = code_of(wrong)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in details
    short = pb.ModelInferRequest(model_name="mlp")
    t = short.inputs.add(name="x", datatype="FP32", shape=[1, 32])
    t.contents.fp32_contents.extend([1.0] * 31)
    code, details = code_of(short)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "needs 32 elements" in details
    wide = pb.ModelInferRequest(model_name="all_dtypes")
    t = wide.inputs.add(name="u8", datatype="UINT8", shape=[1, 4])
    t.contents.uint_contents.extend([1, 2, 3, 256])
    code, details = code_of(wide)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of range for UINT8" in details
    channel.close()


def test_errors_map_to_status_codes(client):
    x = _inputs({"x": np.ones((1, 32), np.float32)})
    assert _status(lambda: client.infer("nope", x))[0] == "StatusCode.NOT_FOUND"
    code, message = _status(lambda: client.infer("mlp", x, model_version="7"))
    assert code == "StatusCode.NOT_FOUND" and "no version '7'" in message
    bad = _inputs({"x": np.ones((1, 31), np.float32)})
    code, message = _status(lambda: client.infer("mlp", bad))
    assert code == "StatusCode.INVALID_ARGUMENT" and "input 'x'" in message
    two_rows = _inputs({"x": np.ones((2, 32), np.float32)})
    code, message = _status(lambda: client.infer("tiny_queue", two_rows))
    assert code == "StatusCode.INVALID_ARGUMENT" and "max_queue" in message
    code, _ = _status(
        lambda: client.infer("mlp", x, outputs=[grpcclient.InferRequestedOutput("z")])
    )
    assert code == "StatusCode.INVALID_ARGUMENT"


def test_a_priority_out_of_range_is_invalid_argument_naming_it(client):
    """Triton's ``priority`` (uint64) from 2**63, beyond the queue's C integer (it was
    INTERNAL), is INVALID_ARGUMENT naming it; one in range that is no level of the
    model is the queue's INVALID_ARGUMENT, from a model with the response cache too."""
    x = _inputs({"x": np.ones((1, 32), np.float32)})
    for model in ("mlp", "cached"):
        client.infer(model, x, priority=1)  # (cached: kept, then hits)
        for bad in (2**63, 2**64 - 1):
            code, message = _status(functools.partial(client.infer, model, x, priority=bad))
            assert code == "StatusCode.INVALID_ARGUMENT", (model, bad, message)
            assert "parameters.priority must be an integer" in message
        for no_level in (2, 2**63 - 1):
            ask = functools.partial(client.infer, model, x, priority=no_level)
            code, message = _status(ask)
            assert code == "StatusCode.INVALID_ARGUMENT", (model, no_level, message)
            assert f"priority {no_level} is not a level" in message


def test_a_malformed_protobuf_is_invalid_argument_in_plain_words(grpc_served):
    """Bytes that are not the method's message: INVALID_ARGUMENT naming the message, no
    Python exception text; in a stream, that request's error and the stream goes on."""
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length past the end
    with grpc.insecure_channel(grpc_served.grpc_url) as channel:
        for method in ("ModelInfer", "ModelMetadata", "RepositoryIndex"):
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(garbage, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            details = info.value.details()
            assert details.startswith("malformed ") and "protobuf" in details
            assert "Error" not in details and "<class" not in details
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        good = _stream_request(3).SerializeToString()
        answers = list(stream(iter([garbage, good]), timeout=10))
    errors = sorted(a.error_message for a in answers)
    assert len(answers) == 2 and errors[0] == "" and "malformed ModelInferRequest" in errors[1]


def test_bool_raw_bytes_other_than_0_and_1_are_invalid_argument(client):
    tokens = np.arange(1, 9, dtype=np.int32).reshape(1, 8)
    good = np.ones((1, 8), np.bool_)
    ok = client.infer("encoder", _inputs({"tokens": tokens, "mask": good}))
    want = encoder_reference({"tokens": tokens, "mask": good})["pooled"]
    assert_matches({"pooled": ok.as_numpy("pooled")}, {"pooled": want})
    for raw, words in [(b"\x01\x02" + b"\x01" * 6, "got 2 at index (0, 1)"),
                       (b"\x01" * 7 + b"\xff", "got 255 at index (0, 7)")]:  # fmt: skip
        bad = np.frombuffer(raw, np.bool_).reshape(1, 8)
        code, message = _status(
            lambda bad=bad: client.infer("encoder", _inputs({"tokens": tokens, "mask": bad}))
        )
        assert code == "StatusCode.INVALID_ARGUMENT", message
        assert "input 'mask': a bool must be the byte 0 or 1" in message and words in message


def test_a_stream_of_1000_with_bad_ones_mixed_in(client):
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    rng = np.random.default_rng(3)
    sent = {}
    for k in range(1000):
        if k % 50 == 7:  # a wrong width: fails alone
            request = {"x": np.ones((1, 31), np.float32)}
        else:
            request = {"x": rng.standard_normal((1 + k % 3, 32)).astype(np.float32)}
        sent[str(k)] = request
        client.async_stream_infer("mlp", _inputs(request), request_id=str(k))
    got = [answers.get(timeout=60) for _ in range(1000)]
    client.stop_stream()
    errors = [e for _, e in got if e is not None]
    results = [r for r, e in got if e is None]
    assert len(errors) == 20 and all("input 'x'" in e.message() for e in errors)
    assert len(results) == 980
    for result in results[::37]:
        rid = result.get_response().id
        assert_matches({"y": result.as_numpy("y")}, reference("mlp", sent[rid]), rid)


def test_asyncio_client(grpc_served):
    async def main():
        async with grpcaio.InferenceServerClient(grpc_served.grpc_url) as c:
            assert await c.is_server_ready()
            rng = np.random.default_rng(4)
            requests = [{"x": rng.standard_normal((2, 32)).astype(np.float32)} for _ in range(20)]
            results = await asyncio.gather(*(c.infer("mlp", _inputs(r)) for r in requests))
            for request, result in zip(requests, results):
                assert_matches({"y": result.as_numpy("y")}, reference("mlp", request))

            async def stream():
                for i, r in enumerate(requests):
                    yield {"model_name": "mlp", "inputs": _inputs(r), "request_id": str(i)}

            seen = {}
            async for result, error in c.stream_infer(stream()):
                assert error is None
                seen[result.get_response().id] = result.as_numpy("y")
                if len(seen) == len(requests):
                    break
            for i, r in enumerate(requests):
                assert_matches({"y": seen[str(i)]}, reference("mlp", r))

    asyncio.run(main())


def test_repository_methods(built_repository):
    from servers import ServeProcess

    root = built_repository
    proc = ServeProcess(
        ["--model-repository", str(root), "--model-control-mode", "explicit"], grpc=True
    )
    try:
        c = grpcclient.InferenceServerClient(proc.grpc_url)
        index = c.get_model_repository_index(as_json=True)["models"]
        assert [(m["name"], m["version"], m["state"]) for m in index] == [
            ("mlp", "1", "UNAVAILABLE")
        ]
        c.load_model("mlp")
        assert c.is_model_ready("mlp")
        x = np.ones((2, 32), np.float32)
        assert_matches({"y": c.infer("mlp", _inputs({"x": x})).as_numpy("y")},
                       reference("mlp", {"x": x}))  # fmt: skip
        c.unload_model("mlp")
        assert not c.is_model_ready("mlp")
        code, message = _status(lambda: c.load_model("nope"))
        assert code == "StatusCode.INVALID_ARGUMENT" and "no model 'nope'" in message
        # A model name is one directory of the repository: no path leaves it, no alias
        # loads another copy, and an existing directory answers as a missing one.
        outside = root.parent / "elsewhere"
        shutil.copytree(root / "mlp", outside)
        names = [str(outside), "mlp/../../elsewhere", "../elsewhere", "mlp/.", "mlp/./.",
                 "..", "mlp\\..", "/etc", "/nope-nope"]  # fmt: skip
        messages = []
        for name in names:
            code, message = _status(lambda name=name: c.load_model(name))
            assert code == "StatusCode.INVALID_ARGUMENT", (name, code, message)
            messages.append(message.replace(repr(name), "NAME"))
            code, _ = _status(lambda name=name: c.unload_model(name))
            assert code == "StatusCode.INVALID_ARGUMENT", name
        assert messages[-1] == messages[-2]  # "/etc" exists, "/nope-nope" does not
        index = c.get_model_repository_index(as_json=True)["models"]
        assert [(m["name"], m["version"]) for m in index] == [("mlp", "1")]
        assert not any(c.is_model_ready(n) for n in names)
        c.close()
    finally:
        assert proc.stop() == 0


@pytest.fixture
def built_repository(tmp_path):
    spec = MODELS["mlp"]
    path = tmp_path / "repo" / "mlp" / "1"
    pxrt.export(
        spec["fn"], spec["params"](), path, inputs=spec["inputs"],
        batch_buckets=spec["buckets"], name="mlp",
    )  # fmt: skip
    return tmp_path / "repo"


def test_a_stream_answers_a_request_cancelled_under_it(artifacts, run):
    # A request whose future is cancelled (not the stream's task) is answered with an
    # error of its own; the stream goes on and ends, instead of waiting for it forever.
    from serving import Server
    from serving.grpc.service import GRPCService

    async def main():
        async with Server() as server:
            server.add_model("mlp", pxrt.load(artifacts["mlp"]))
            service = GRPCService(server)
            submit = server.submit

            def cancelling_submit(name, inputs, **kw):
                future = submit(name, inputs, **kw)
                if inputs["x"][0, 0] == 7:
                    future.cancel()
                return future

            server.submit = cancelling_submit
            requests = []
            for i in range(6):
                x = np.full((1, 32), 7 if i == 2 else i, np.float32)
                r = pb.ModelInferRequest(model_name="mlp", id=str(i))
                r.inputs.add(name="x", datatype="FP32", shape=[1, 32])
                r.raw_input_contents.append(x.tobytes())
                requests.append(r)

            async def stream():
                for r in requests:
                    yield r

            answers = [a async for a in service.ModelStreamInfer(stream(), None)]
            return {a.infer_response.id: a for a in answers}

    answers = run(main)
    assert sorted(answers) == [str(i) for i in range(6)]
    assert "cancelled" in answers["2"].error_message
    assert all(not answers[str(i)].error_message for i in (0, 1, 3, 4, 5))


def _stream_request(i: int) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="mlp", id=str(i))
    r.inputs.add(name="x", datatype="FP32", shape=[1, 32])
    r.raw_input_contents.append(np.full((1, 32), i, np.float32).tobytes())
    return r


class Aborted(Exception):
    pass


class Context:
    """What a servicer sees of grpc's context: ``abort`` raises, as grpc's does."""

    code = details = None

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


def test_a_stream_is_not_read_past_its_cap_while_its_answers_wait(models, run):
    """A client that sends and does not read: the stream reads max_stream_inflight
    requests, then no more until an answer is written (HTTP/2 flow control holds the
    client), so the server's memory does not grow with what the client sends."""
    from serving import Server
    from serving.grpc.service import GrpcLimits, GRPCService

    async def main():
        read = 0

        async def endless():
            nonlocal read
            while True:
                read += 1
                yield _stream_request(read)

        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            service = GRPCService(server, limits=GrpcLimits(max_stream_inflight=8))
            answers = service.ModelStreamInfer(endless(), Context())
            first = await anext(answers)  # then nobody takes the next answer
            await until(lambda: server.stats("mlp")["requests"]["success"] == 8)
            await asyncio.sleep(0.1)  # time to read on, were the reading not held
            assert read == 8 and not first.error_message
            for _ in range(3):  # each answer written lets one more request be read
                assert not (await anext(answers)).error_message
            await until(lambda: read == 11)
            await answers.aclose()

    run(main)


def test_a_draining_server_answers_what_a_stream_read_then_ends_it_unavailable(models, run):
    """Drain: the requests read (here held on the device) are answered, the stream is
    not read further and ends with UNAVAILABLE, so the client knows to go elsewhere."""
    from serving import Server
    from serving.grpc.service import GRPCService

    async def main():
        feed: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (r := await feed.get()) is not None:
                yield r

        context = Context()
        with inject(models["mlp"], hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", models["mlp"])
                answers = GRPCService(server).ModelStreamInfer(requests(), context)
                for i in range(3):
                    feed.put_nowait(_stream_request(i))
                got = asyncio.ensure_future(anext(answers))
                await gate.wait_started()
                await until(lambda: feed.empty())  # all three read
                server.drain()
                for _ in range(5):
                    await asyncio.sleep(0)  # the stream sees the drain
                feed.put_nowait(_stream_request(99))  # after the drain: not read
                gate.release.set()
                ids = [(await got).infer_response.id]
                ids += [(await anext(answers)).infer_response.id for _ in range(2)]
                with pytest.raises(Aborted):  # (a stream that is not ended: TimeoutError)
                    await asyncio.wait_for(anext(answers), 30)
            return ids, context.code, feed.qsize()

    ids, code, unread = run(main)
    assert sorted(ids) == ["0", "1", "2"] and unread == 1
    assert code == grpc.StatusCode.UNAVAILABLE


def _open_fds(proc) -> int:
    return len(os.listdir(f"/proc/{proc.proc.pid}/fd"))


def _silent_sockets(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
def test_one_connection_budget_over_both_listeners(artifacts):
    """A flood of silent sockets on either port holds at most that listener's share of
    --max-connections, so the fds never run out and the other port keeps serving; the
    silent ones are closed after the handshake (header) timeout."""
    from servers import ServeProcess

    from serving.http.limits import linger_allowance

    proc = ServeProcess(
        [str(artifacts["mlp"]), "--max-connections", "40", "--max-grpc-connections", "10",
         "--header-timeout-s", "1"],
        grpc=True,
    )  # fmt: skip
    x = np.ones((2, 32), np.float32)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 32],
                        "data": x.ravel().tolist()}]}  # fmt: skip
    want = reference("mlp", {"x": x})

    def http_ok() -> bool:
        r = httpx.post(proc.url + "/v2/models/mlp/infer", json=body, timeout=10)
        return r.status_code == 200

    def grpc_ok() -> bool:
        with grpcclient.InferenceServerClient(proc.grpc_url) as c:
            assert_matches({"y": c.infer("mlp", _inputs({"x": x})).as_numpy("y")}, want)
        return True

    try:
        assert http_ok() and grpc_ok()
        for port, share, other_ok in ((proc.grpc_port, 10, http_ok), (proc.port, 30, grpc_ok)):
            base = _open_fds(proc)
            socks = _silent_sockets(port, 200)
            try:
                time.sleep(0.3)
                # (HTTP: refused ones may linger, a bounded few, to be closed without RST)
                extra = linger_allowance(share) if port == proc.port else 0
                assert _open_fds(proc) - base <= share + extra + 4, (port, _open_fds(proc) - base)
                assert other_ok()  # the other listener is untouched
                deadline = time.monotonic() + 10
                while _open_fds(proc) - base > 4 and time.monotonic() < deadline:
                    time.sleep(0.1)  # the silent ones time out
                assert _open_fds(proc) - base <= 4
            finally:
                for s in socks:
                    s.close()
        assert http_ok() and grpc_ok()
    finally:
        assert proc.stop() == 0


class _Aborted(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class _Context:
    """What the servicer reads of a grpc.aio context."""

    def time_remaining(self):
        return None

    async def abort(self, code, message):
        raise _Aborted(code, message)


def _infer_message(x, version=""):
    r = pb.ModelInferRequest(model_name="mlp", model_version=version)
    r.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    r.raw_input_contents.append(x.tobytes())
    return r


def test_statistics_per_version_and_unexpected_errors_are_internal_and_counted(
    artifacts, run, monkeypatch
):
    """Each version's statistics are its own; an unexpected error (a TypeError inside
    the server, not the request's fault) is INTERNAL, not INVALID_ARGUMENT, and counts
    as failed."""
    import grpc

    from serving import Server
    from serving.grpc.service import GRPCService
    from serving.kserve import codec

    x = np.ones((1, 32), np.float32)

    async def main():
        async with Server() as server:
            await server.load_model("mlp", artifacts["mlp"], version="1")
            await server.load_model("mlp", artifacts["mlp"], version="2")
            service = GRPCService(server)
            ctx = _Context()
            for version, n in (("1", 3), ("2", 5)):
                for _ in range(n):
                    await service.ModelInfer(_infer_message(x, version), ctx)

            async def stats(version):
                request = pb.ModelStatisticsRequest(name="mlp", version=version)
                return (await service.ModelStatistics(request, ctx)).model_stats[0]

            per_version = {v: await stats(v) for v in ("1", "2", "")}
            real = codec.datatype_of
            monkeypatch.setattr(codec, "datatype_of", lambda dtype: real(dtype)[:0] + 1)
            with pytest.raises(_Aborted) as info:
                await service.ModelInfer(_infer_message(x, "1"), ctx)
            monkeypatch.setattr(codec, "datatype_of", real)
            failed = await stats("1")
            return per_version, info.value, failed

    per_version, aborted, failed = run(main)
    assert [(s.version, s.inference_stats.success.count) for s in per_version.values()] == [
        ("1", 3),
        ("2", 5),
        ("2", 5),  # no version: the newest
    ]
    assert aborted.code == grpc.StatusCode.INTERNAL, aborted
    assert str(aborted).startswith("internal error: TypeError")
    stats = failed.inference_stats  # it ran (a success of the batch), its caller got INTERNAL
    assert stats.fail.count == 1 and stats.success.count == 4


def test_tls_and_restricted_apis_with_the_triton_client(artifacts, tmp_path):
    """Over TLS (the client trusting the test CA): inference with its key, the
    repository and statistics with theirs; without a key, PERMISSION_DENIED, on the
    stream too."""
    from servers import ServeProcess, make_certs

    certs = make_certs(tmp_path)
    proc = ServeProcess(
        [
            str(artifacts["mlp"]),
            "--restricted-api", "model-repository,statistics:admin-key=s3cret",
            "--restricted-api", "inference:infer-key=abc",
            "--restricted-api", "shared-memory:shm-key=k3y", "--allow-client-shm",
        ],
        grpc=True,
        tls=certs,
    )  # fmt: skip
    with open(certs["ca"], "rb") as f:
        ca = f.read()
    try:
        client = grpcclient.InferenceServerClient(
            f"localhost:{proc.grpc_port}", ssl=True, root_certificates=certs["ca"]
        )
        x = _inputs({"x": np.ones((1, 32), np.float32)})
        assert client.is_server_ready()  # health is open
        out = client.infer("mlp", x, headers={"infer-key": "abc"}).as_numpy("y")
        assert out.shape[0] == 1
        wrong = {"infer-key": "wrong"}
        for call in (
            lambda: client.infer("mlp", x, headers=wrong),
            lambda: client.get_inference_statistics("mlp", headers=wrong),
            lambda: client.get_model_repository_index(headers=wrong),
            lambda: client.load_model("mlp", headers=wrong),
            lambda: client.get_system_shared_memory_status(headers=wrong),
            lambda: client.unregister_system_shared_memory(headers={"infer-key": "abc"}),
        ):
            code, message = _status(call)
            assert code == "StatusCode.PERMISSION_DENIED" and "restricted" in message
        stats = client.get_inference_statistics("mlp", headers={"admin-key": "s3cret"})
        assert stats.model_stats[0].inference_stats.success.count == 1
        code, _ = _status(
            lambda: client.get_model_repository_index(headers={"admin-key": "s3cret"})
        )
        assert code == "StatusCode.FAILED_PRECONDITION"  # allowed; no repository here
        assert not client.get_system_shared_memory_status(headers={"shm-key": "k3y"}).regions
        # naming a region at inference needs the shared-memory key too
        shared = grpcclient.InferInput("x", [1, 32], "FP32")
        shared.set_shared_memory("any", 128)
        code, message = _status(lambda: client.infer("mlp", [shared], headers={"infer-key": "abc"}))
        assert code == "StatusCode.PERMISSION_DENIED" and "shared-memory" in message
        # a key sent twice (which one counts would depend on the reader): INVALID_ARGUMENT
        from tritonclient.grpc import service_pb2_grpc

        with grpc.secure_channel(
            f"localhost:{proc.grpc_port}", grpc.ssl_channel_credentials(ca)
        ) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = pb.ModelInferRequest(model_name="mlp")
            request.inputs.add(name="x", datatype="FP32", shape=[1, 32])
            request.raw_input_contents.append(np.ones((1, 32), np.float32).tobytes())
            for call, message, key in [
                (stub.ModelInfer, request, ("infer-key", "abc")),
                (stub.ModelStatistics, pb.ModelStatisticsRequest(name="mlp"),
                 ("admin-key", "s3cret")),
            ]:  # fmt: skip
                call(message, metadata=[key], timeout=10)
                with pytest.raises(grpc.RpcError) as caught:
                    call(message, metadata=[key, key], timeout=10)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "sent 2 times" in caught.value.details()

        answers: queue.Queue = queue.Queue()
        client.start_stream(lambda result, error: answers.put(error), headers={})
        try:
            client.async_stream_infer("mlp", x)
        except InferenceServerException:
            pass  # the stream was refused already: its error went to the callback
        error = answers.get(timeout=30)
        client.stop_stream()
        assert error is not None and "PERMISSION_DENIED" in str(error.status())
        client.close()
        with grpc.secure_channel(
            f"localhost:{proc.grpc_port}", grpc.ssl_channel_credentials(ca)
        ) as channel:  # and a plain-text client is not served on the TLS port
            grpc.channel_ready_future(channel).result(timeout=10)
        plain = grpcclient.InferenceServerClient(f"localhost:{proc.grpc_port}")
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)
        plain.close()
    finally:
        assert proc.stop() == 0


def test_grpc_through_workers(served_workers):
    """`pxrt serve --workers 2`: gRPC answered as by one process (tensors through shared
    memory both ways), methods other than inference by the device process."""
    with grpcclient.InferenceServerClient(served_workers.grpc_url) as c:
        assert c.is_server_ready() and c.get_model_metadata("mlp", as_json=True)["name"] == "mlp"
        x = np.random.default_rng(2).standard_normal((3000, 32)).astype(np.float32)
        result = c.infer("mlp", _inputs({"x": x}))
        assert_matches({"y": result.as_numpy("y")}, reference("mlp", {"x": x}))
        code, message = _status(lambda: c.get_inference_statistics("mlp"))
        assert code == "StatusCode.PERMISSION_DENIED" and "restricted" in message
        answers: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        for k in range(50):
            c.async_stream_infer("mlp", _inputs({"x": np.full((1, 32), k, np.float32)}),
                                 request_id=str(k))  # fmt: skip
        got = [answers.get(timeout=60) for _ in range(50)]
        c.stop_stream()
        assert all(error is None for _, error in got)
        assert sorted(int(r.get_response().id) for r, _ in got) == list(range(50))
        # A priority beyond the queue's C integer is refused in the worker, naming it.
        code, message = _status(lambda: c.infer("mlp", _inputs({"x": x[:1]}), priority=2**63))
        assert code == "StatusCode.INVALID_ARGUMENT" and "parameters.priority" in message


def test_grpc_trace_settings_take_one_value_per_setting():
    """gRPC sends each setting as a list of strings: a rate of two values is refused
    (it used to take the first), an empty one is Triton's default. (Here, not in
    test_tracing.py: serving.grpc.service imports tritonclient.grpc's protobufs.)"""
    from opentelemetry.sdk.trace import TracerProvider
    from tritonclient.grpc import service_pb2 as pb

    from serving.grpc.service import _trace_setting
    from serving.kserve.codec import ProtocolError
    from serving.tracing import Tracing

    def request(**values):
        out = pb.TraceSettingRequest()
        for key, value in values.items():
            out.settings[key].value.extend(value)
        return out

    tracing = Tracing(5, TracerProvider())
    with pytest.raises(ProtocolError, match=r"trace_rate must be .*got \['2', '3'\]"):
        _trace_setting(tracing, request(trace_rate=["2", "3"]))
    with pytest.raises(ProtocolError, match="trace_rate must be from 0 to 4294967295"):
        _trace_setting(tracing, request(trace_rate=[str(2**64)]))
    got = _trace_setting(tracing, request(trace_rate=["9"], trace_count=["4"]))
    assert got["trace_rate"] == "9" and got["trace_count"] == "4"
    got = _trace_setting(tracing, request(trace_rate=[], trace_count=[]))
    assert got["trace_rate"] == "1000" and got["trace_count"] == "-1"
