"""The response cache: a repeated request is answered from it, equal to plain JAX, without
a batch; it is bounded in bytes, least recently used out first; it keeps only answers that
succeeded; each model opts in, decoders never."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.http as httpclient
from models import assert_matches, inject, random_request, reference, until

from serving import BatchingOptions, OptionError, Server, ServerClosed
from serving.engine.cache import request_digest


def test_a_repeated_request_is_answered_from_the_cache(run, models):
    model = models["two_io"]
    rng = np.random.default_rng(3)
    distinct = [random_request(model.inputs, int(rng.integers(1, 4)), rng) for _ in range(6)]
    # Each distinct request four times, interleaved; one with a wrong dtype among them.
    stream = [r for _ in range(4) for r in distinct]
    bad = dict(distinct[0], features=distinct[0]["features"].astype(np.float32))
    sent = [*stream[:5], bad, *stream[5:]]

    async def main():
        async with Server() as server:
            server.add_model("cached", model, response_cache=True, max_delay_us=2000)
            server.add_model("plain", model)
            first = await asyncio.gather(*(server.infer("cached", r) for r in distinct))
            batches = server.metrics_snapshot()["cached"]["batches"]
            outs = await asyncio.gather(
                *(server.infer("cached", r) for r in sent), return_exceptions=True
            )
            await asyncio.gather(*(server.infer("plain", r) for r in distinct * 2))
            snap = server.metrics_snapshot()
            return first, batches, outs, snap, server.response_cache

    first, batches, outs, snap, cache = run(main)
    for r, got in zip(distinct, first):
        assert_matches(got, reference("two_io", r))
    assert isinstance(outs[5], TypeError) and "'features'" in str(outs[5])
    del outs[5]
    for r, got in zip(stream, outs):
        assert_matches(got, reference("two_io", r))
        assert all(not v.flags.writeable for v in got.values())  # (shared: read-only)
    cached = snap["cached"]
    assert cached["batches"] == batches  # every repeat came from the cache
    counts = cached["response_cache"]
    assert counts["hits"] == len(stream) and counts["misses"] == len(distinct) + 1
    assert cached["requests"]["success"] == len(distinct) + len(stream)
    assert cached["requests"]["invalid"] == 1
    assert "response_cache" not in snap["plain"]  # (it did not opt in)
    assert len(cache) == 0  # the server closed: its models' answers went with them


def test_the_cache_is_bounded_in_bytes_least_recently_used_out(run, models):
    model = models["mlp"]
    rng = np.random.default_rng(4)
    requests = [random_request(model.inputs, 4, rng) for _ in range(12)]
    entry = sum(v.nbytes for v in reference("mlp", requests[0]).values())

    async def main():
        # Room for five answers.
        async with Server(response_cache_mb=5.5 * entry / 2**20) as server:
            server.add_model("m", model, response_cache=True)
            for r in requests:
                await server.infer("m", r)
            cache = server.response_cache
            held = (len(cache), cache.bytes, cache.evictions)
            await server.infer("m", requests[-1])  # the newest: kept
            await server.infer("m", requests[0])  # the oldest: evicted long ago
            # copy=True hands out owned arrays, hit or not
            server.add_model("c", model, response_cache=True, copy=True)
            await server.infer("c", requests[1])
            copied = await server.infer("c", requests[1])
            text = server.metrics.registry and _exposition(server)
            return held, server.metrics_snapshot()["m"]["response_cache"], copied, text

    (entries, size, evictions), counts, copied, text = run(main)
    assert entries == 5 and size == 5 * entry and evictions == 7
    assert counts["hits"] == 1 and counts["misses"] == 13
    assert all(v.flags.writeable for v in copied.values())
    assert_matches(copied, reference("mlp", requests[1]))
    assert 'pxrt_cache_hits_total{model="m",version="1"} 1.0' in text
    assert 'pxrt_cache_misses_total{model="c",version="1"} 1.0' in text
    assert "pxrt_cache_evictions_total" in text and "pxrt_cache_bytes" in text


def test_a_request_the_queue_refuses_is_refused_before_the_lookup(run, models):
    """A hit answers nothing a miss would refuse: a priority that is no level of the
    model is refused (and counted invalid) though its inputs are cached, and so is any
    request once the model is closing, while its accepted ones drain."""
    model = models["mlp"]
    x = np.ones((1, 32), np.float32)

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model(
                    "m", model, response_cache=True, priority_levels=2, max_batch_size=1,
                    max_inflight=1,
                )  # fmt: skip
                gate.release.set()
                await server.infer("m", {"x": x})  # kept
                await server.infer("m", {"x": x}, priority=2)  # a hit at a level it has
                with pytest.raises(ValueError, match="priority 3 is not a level of this model"):
                    await server.infer("m", {"x": x}, priority=3)
                snap = server.metrics_snapshot()["m"]
                gate.release.clear()
                gate.started.clear()
                busy = asyncio.ensure_future(server.infer("m", {"x": 2 * x}))
                await gate.wait_started()  # the device is busy: closing waits for it
                closing = asyncio.ensure_future(server.close())
                await until(lambda: server._batcher("m").queue.closed)
                with pytest.raises(ServerClosed):
                    await server.infer("m", {"x": x})
                gate.release.set()
                await busy
                await closing
        return snap

    snap = run(main)
    assert snap["response_cache"]["hits"] == 1
    assert snap["requests"]["invalid"] == 1


def _exposition(server) -> str:
    from prometheus_client import generate_latest

    return generate_latest(server.metrics.registry).decode()


def test_the_key_is_every_input_byte_dtype_and_shape():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    key = request_digest({"x": x})
    assert key == request_digest({"x": x.copy()})
    assert key == request_digest({"x": np.asfortranarray(x)})  # (the values, not the layout)
    assert key != request_digest({"x": x.reshape(3, 2)})
    assert key != request_digest({"x": x.view(np.int32)})
    assert key != request_digest({"y": x})
    y = x.copy()
    y[1, 2] = np.nextafter(y[1, 2], 10)
    assert key != request_digest({"x": y})
    assert request_digest({"x": x, "y": x}) == request_digest({"y": x, "x": x})
    assert request_digest({"s": np.array([b"a"], object)}) is None  # never cached


def test_options_are_checked(run, models):
    assert BatchingOptions.check("response_cache", {"enable": True}) is True
    with pytest.raises(OptionError, match="response_cache: 'yes' is not true or false"):
        BatchingOptions(response_cache="yes")

    async def main():
        async with Server(response_cache_mb=0) as server:
            with pytest.raises(OptionError, match="has no response cache"):
                server.add_model("m", models["mlp"], response_cache=True)
        async with Server() as server:
            # A decoder is refused before it is looked at.
            with pytest.raises(OptionError, match="'lm' is a decoder"):
                server.add_decoder("lm", None, BatchingOptions(response_cache=True))  # type: ignore[arg-type]

    run(main)
    with pytest.raises(ValueError, match="response_cache_mb must be a number >= 0"):
        Server(response_cache_mb=-1)


@pytest.mark.once
def test_served_over_http_with_triton_statistics(served, models):
    """`pxrt serve` with ``response_cache = {enable = true}`` in a model's TOML section:
    Triton's client gets the same answers, and its statistics count hits and misses
    (over gRPC: tests/test_grpc.py)."""
    model = models["mlp"]
    request = random_request(model.inputs, 2, np.random.default_rng(7))
    want = reference("mlp", request)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{served.port}")

    def counts():
        stats = client.get_inference_statistics("cached")["model_stats"][0]["inference_stats"]
        return int(stats["cache_hit"]["count"]), int(stats["cache_miss"]["count"])

    hits, misses = counts()
    for binary in (True, False, True):
        inputs = [httpclient.InferInput("x", list(request["x"].shape), "FP32")]
        inputs[0].set_data_from_numpy(request["x"], binary_data=binary)
        got = client.infer("cached", inputs).as_numpy("y")
        np.testing.assert_allclose(got, want["y"], rtol=1e-5, atol=1e-5)
    assert counts() == (hits + 2, misses + 1)
    assert client.get_model_config("cached")["response_cache"] == {"enable": True}
    assert client.get_model_config("mlp")["response_cache"] == {"enable": False}
