"""`pxrt serve --workers N`: the link between a worker and the device process in one
process (deterministic: batches held, requests cancelled, shared memory counted), and
whole `pxrt serve --workers 2` processes driven by unmodified clients: the same answers
as one process, one view of statistics and metrics, a dead worker replaced, SIGTERM
drained."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from models import MODELS, assert_matches, inject, reference, until

from pxrt import SamplingParams
from serving import Server
from serving.workers import ipc
from serving.workers.remote import DeviceLink, RemoteServer
from serving.workers.supervisor import WorkerLink, model_state


class _Supervisor:
    """What a WorkerLink needs of its Supervisor."""

    def __init__(self, server, app=None, methods=None) -> None:
        self.server = server
        self.app = app
        self.methods = methods or {}
        self.links: list = []

    def lost(self, link) -> None:
        self.links.append(("lost", link.index))


async def _linked(server: Server):
    """A RemoteServer talking to ``server`` through a socket pair on this loop."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    supervisor = _Supervisor(server)
    _, device = await loop.connect_accepted_socket(lambda: WorkerLink(supervisor, 0), ours)
    server.watch(device.send_state)
    remote = RemoteServer()
    await loop.connect_accepted_socket(lambda: DeviceLink(remote), theirs)
    await asyncio.wait_for(remote.started.wait(), 10)
    return remote, device


def test_a_worker_sees_the_models_and_their_answers(models, run):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            remote, device = await _linked(server)
            assert remote.not_serving() is None
            assert remote.model("mlp").version == models["mlp"].version
            assert list(remote.model("mlp").inputs) == ["x"]
            rng = np.random.default_rng(0)
            for rows in (1, 3, 3000):  # 3000 rows: 384 KB each way, through shared memory
                x = rng.standard_normal((rows, 32)).astype(np.float32)
                out = await remote.submit("mlp", {"x": x})
                assert_matches(out, reference("mlp", {"x": x}), str(rows))
            # every byte of shared memory given back on both sides
            await until(lambda: remote.arena.used == {} and device.ours.used == {})
            with pytest.raises(KeyError, match="no model named 'nope'"):
                remote.submit("nope", {"x": x})
            bad = remote.submit("mlp", {"x": np.ones((1, 31), np.float32)})
            with pytest.raises(ValueError, match="input 'x'"):
                await bad  # the device process's validation, raised as in one process
            # models added later reach the worker (Server.watch)
            server.add_model("two_io", models["two_io"])
            await until(lambda: "two_io" in remote.models)
            server.drain()
            await until(lambda: remote.draining and remote.not_serving() is not None)
            remote.close()

    run(main)


def test_a_cancelled_request_leaves_the_device_queue_and_its_memory_is_freed(models, run):
    async def main():
        with inject(models["mlp"], hold=True) as gate:
            async with Server() as server:
                # One batch in flight: while it is held, the others wait in the queue.
                server.add_model("mlp", models["mlp"], max_inflight=1)
                remote, device = await _linked(server)
                first = remote.submit("mlp", {"x": np.ones((1, 32), np.float32)})
                await gate.wait_started()
                big = np.ones((600, 32), np.float32)  # 77 KB: in shared memory while it waits
                waiting = [remote.submit("mlp", {"x": big}) for _ in range(3)]
                await until(lambda: len(device.pending) == 4)
                assert len(remote.arena.used) == 3
                for future in waiting:
                    future.cancel()  # a client that hung up
                # (The cancellations reach the device side before the held batch ends:
                # released first, the waiting requests could run before they arrive.)
                await until(lambda: len(device.pending) == 1)
                gate.release.set()
                await first
                await until(lambda: not remote.arena.used and not device.pending)
                await until(lambda: server.stats("mlp")["requests"].get("success") == 1)
                assert server.stats("mlp")["requests"]["cancelled"] == 3
                remote.close()

    run(main)


def test_a_lost_device_fails_what_waits_on_it(models, run):
    async def main():
        with inject(models["mlp"], hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", models["mlp"])
                remote, device = await _linked(server)
                waiting = remote.submit("mlp", {"x": np.ones((1, 32), np.float32)})
                await gate.wait_started()
                device.transport.close()  # the device process is gone
                with pytest.raises(Exception, match="device process is gone"):
                    await asyncio.wait_for(waiting, 10)
                assert remote.not_serving() is not None
                gate.release.set()
                remote.close()

    run(main)


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    from pxrt import demo

    return demo.export_lm(
        str(tmp_path_factory.mktemp("lm") / "lm"), slots=2, max_length=1024,
        prefill_lengths=(8, 16), prefill_batches=(1, 2), dim=16, heads=2, layers=1,
        extend=False,
    )  # fmt: skip


@pytest.fixture
def lm(lm_path):
    import pxrt

    # (closed by the server it is added to; no steps over fewer slots or positions, which
    # test_generate.py has: the programs a worker drives are the same)
    dec = pxrt.load(lm_path, step_slots=(), step_lengths=())
    yield dec
    dec.close()


def test_a_worker_generates_through_the_device_process(lm, run):
    """A worker's generations run in the device process: the engine's tokens and finish
    reason, a refusal raised as the engine raises it, a cancel (a client that hung up)
    frees the slot, a lost device ends what streams."""

    async def main():
        async with Server() as server:
            server.add_decoder("lm", lm)
            remote, device = await _linked(server)
            decoder = remote.decoder("lm")
            assert remote.is_decoder("lm") and not remote.is_decoder("nope")
            assert decoder.version == lm.version and decoder.tokenizer.encode("A") == [65]
            cases = [
                ([1, 2, 3], {"max_tokens": 7}),
                ([9] * 12, {"max_tokens": 20, "temperature": 2.0, "seed": 4}),
            ]
            for prompt, options in cases:
                want = lm.generate(prompt, **options)
                gen = await remote.open_generation("lm", prompt, **options)
                assert [t async for t in gen] == want.tokens
                assert gen.finish_reason == want.finish_reason and gen.delivered == len(want.tokens)
            with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
                await remote.open_generation("lm", [999])
            # A bad parameter is refused here, before anything crosses to the device
            # process; one that depends on the model (a stop id outside its vocabulary)
            # is refused there, as the engine refuses it.
            sent = len(device.generations)
            with pytest.raises(ValueError, match="temperature must be a number from 0 to 100"):
                await remote.open_generation("lm", [1], temperature=-1)
            with pytest.raises(ValueError, match="unknown sampling option 'max_token'"):
                await remote.open_generation("lm", [1], max_token=3)
            with pytest.raises(ValueError, match="stop_ids must be an int from 0 to 257"):
                await remote.open_generation("lm", [1], SamplingParams(stop_ids=(4096,)))
            assert not remote._generations and len(device.generations) == sent
            typed = SamplingParams(max_tokens=5, temperature=0.5, seed=9, logit_bias={65: 5})
            want = lm.generate([7, 8], typed)
            gen = await remote.open_generation("lm", [7, 8], typed)
            assert [t async for t in gen] == want.tokens
            with pytest.raises(KeyError, match="no model named 'nope'"):
                await remote.open_generation("nope", [1])
            long = await remote.open_generation("lm", [1, 2], max_tokens=1000, stop_ids=[])
            async for _ in long:
                break
            assert lm.busy_slots == 1
            long.cancel("stop")
            await until(lambda: lm.busy_slots == 0 and not device.generations)
            assert long.finish_reason == "stop" and not remote._generations
            gone = await remote.open_generation("lm", [1, 2], max_tokens=1000, stop_ids=[])
            device.transport.close()  # the device process is gone
            with pytest.raises(Exception, match="device process is gone"):
                async for _ in gone:
                    pass
            await until(lambda: lm.busy_slots == 0)  # its generation was cancelled there
            remote.close()

    run(main)


def test_messages_round_trip_and_arena_allocation():
    arena = ipc.Arena(1 << 20)
    try:
        offsets = [arena.alloc(100_000) for _ in range(10)]
        assert -1 not in offsets and arena.alloc(1 << 20) == -1  # full enough
        for offset in offsets[::2]:
            arena.free(offset)
        for offset in offsets[1::2]:
            arena.free(offset)
        assert arena.free_list == [(0, arena.size)]  # coalesced back to one
        x = np.arange(20_000, dtype=np.float32).reshape(100, 200)
        tensor = ipc.to_tensor("x", x, arena)
        assert tensor.offset >= 0 and tensor.data is None
        message = ipc.Infer(7, "m", None, 1.5, [tensor, ipc.to_tensor("s", x[:2], arena)])
        (back,) = ipc.Reader(ipc.ToDevice).feed(ipc.frame(message))
        assert back.rid == 7 and back.timeout_s == 1.5
        np.testing.assert_array_equal(ipc.from_tensor(back.inputs[0], arena), x)
        np.testing.assert_array_equal(ipc.from_tensor(back.inputs[1], None), x[:2])
        # frames split anywhere come out whole
        data = ipc.frame(message) * 3
        reader = ipc.Reader(ipc.ToDevice)
        got = [m for i in range(0, len(data), 7) for m in reader.feed(data[i : i + 7])]
        assert [m.rid for m in got] == [7, 7, 7]
    finally:
        arena.close()


def test_state_describes_every_version(models, run):
    async def main():
        async with Server() as server:
            server.add_model("encoder_like", models["mlp"])
            state = model_state(server, "arena")
            (served,) = state.models
            assert served.name == "encoder_like" and served.newest == models["mlp"].version
            assert served.versions[0].inputs[0] == ipc.Spec("x", "float32", [32], 0)

    run(main)


# --------------------------------------------------------------------------- processes


def _worker_pids(proc) -> list[int]:
    from servers import children

    pids = []
    for pid in children(proc.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"serving.workers.worker" in f.read():
                    pids.append(pid)
        except FileNotFoundError:
            continue
    return pids


def _infer_http(url: str, name: str, request: dict, headers=None) -> httpx.Response:
    import tritonclient.http as th

    inputs = []
    for key, value in request.items():
        from serving.kserve import codec

        inp = th.InferInput(key, list(value.shape), codec.datatype_of(value.dtype))
        inp.set_data_from_numpy(value, binary_data=True)
        inputs.append(inp)
    body, header_length = th.InferenceServerClient.generate_request_body(inputs)
    hdrs = {"Inference-Header-Content-Length": str(header_length), **(headers or {})}
    return httpx.post(f"{url}/v2/models/{name}/infer", content=body, headers=hdrs, timeout=30)


def test_workers_answer_as_one_process_does(served_workers):
    import tritonclient.http as th

    client = th.InferenceServerClient(served_workers.url[len("http://") :])
    rng = np.random.default_rng(1)
    for name in ("mlp", "two_io"):
        for rows in (1, 5, 2 * MODELS[name]["buckets"][-1] + 1, 2000):
            from models import random_request

            request = random_request(MODELS[name]["inputs"], rows, rng)
            inputs = []
            for key, value in request.items():
                from serving.kserve import codec

                inp = th.InferInput(key, list(value.shape), codec.datatype_of(value.dtype))
                inp.set_data_from_numpy(value, binary_data=rows > 5)
                inputs.append(inp)
            result = client.infer(name, inputs)
            got = {k: result.as_numpy(k) for k in reference(name, request)}
            assert_matches(got, reference(name, request), f"{name} rows={rows}")
    # errors as one process answers them
    r = httpx.post(served_workers.url + "/v2/models/nope/infer", json={"inputs": []}, timeout=10)
    assert r.status_code == 404 and "no model named 'nope'" in r.json()["error"]
    bad = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    r = httpx.post(served_workers.url + "/v2/models/mlp/infer", json=bad, timeout=10)
    assert r.status_code == 400 and "input 'x'" in r.json()["error"]
    two = _infer_http(served_workers.url, "tiny_queue", {"x": np.ones((2, 32), np.float32)})
    assert two.status_code == 400 and "max_queue" in two.json()["error"]  # more than it holds
    # everything else is the device process's: one view whatever the worker
    assert (
        httpx.get(served_workers.url + "/v2/models/mlp/config", timeout=10).json()["name"] == "mlp"
    )
    assert httpx.get(served_workers.url + "/v2/models/mlp/stats", timeout=10).status_code == 403
    # system shared memory: a registration and the requests that use it would reach
    # different processes, so it is refused by name, on both paths
    r = httpx.post(
        served_workers.url + "/v2/systemsharedmemory/region/r/register",
        json={"key": "/k", "offset": 0, "byte_size": 64},
        timeout=10,
    )
    assert r.status_code == 400 and "--workers" in r.json()["error"]
    region = {"shared_memory_region": "r", "shared_memory_byte_size": 128}
    shared = {"name": "x", "datatype": "FP32", "shape": [1, 32], "parameters": region}
    r = httpx.post(
        served_workers.url + "/v2/models/mlp/infer", json={"inputs": [shared]}, timeout=10
    )
    assert r.status_code == 400 and "--workers" in r.json()["error"]
    client.close()


def test_statistics_and_metrics_are_one_view_over_workers(served_workers):
    key = {"admin-key": "s3cret"}

    def successes():
        doc = httpx.get(
            served_workers.url + "/v2/models/two_io/stats", headers=key, timeout=10
        ).json()
        return doc["model_stats"][0]["inference_stats"]["success"]["count"]

    before = successes()
    x = {"tokens": np.ones((1, 5), np.int32), "features": np.ones((1, 8), np.float16)}
    for _ in range(20):  # a new connection each: both workers take some
        assert _infer_http(served_workers.url, "two_io", x).status_code == 200
    assert successes() == before + 20
    metrics = httpx.get(served_workers.url + "/metrics", headers=key, timeout=10).text
    line = [m for m in metrics.splitlines() if m.startswith("pxrt_requests_total{")
            and 'model="two_io"' in m and 'outcome="success"' in m]  # fmt: skip
    assert float(line[0].split()[-1]) == before + 20


def test_workers_run_without_jax(served_workers):
    pids = _worker_pids(served_workers)
    assert len(pids) == 2
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            assert "jaxlib" not in f.read()


def test_a_worker_that_dies_is_replaced_and_sigterm_drains(artifacts):
    from servers import ServeProcess

    proc = ServeProcess([str(artifacts["mlp"]), "--workers", "2"])
    x = {"x": np.ones((2, 32), np.float32)}
    try:
        before = _worker_pids(proc)
        os.kill(before[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = _worker_pids(proc)
            if len(now) == 2 and before[0] not in now:
                break
            time.sleep(0.1)
        assert len(now) == 2 and before[0] not in now, now
        for _ in range(10):  # served by whichever worker takes the connection
            assert _infer_http(proc.url, "mlp", x).status_code == 200
        assert "exited with" in proc.output()
        # SIGTERM under traffic: every request sent is answered (200, or 503 draining)
        codes: list[int] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                try:
                    codes.append(_infer_http(proc.url, "mlp", x).status_code)
                except httpx.TransportError:
                    codes.append(-1)  # refused: the listener closed (not sent)

        threads = [threading.Thread(target=traffic) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(60) == 0
        stop.set()
        for t in threads:
            t.join()
        assert codes.count(200) > 0 and set(codes) <= {200, 503, -1}, set(codes)
    finally:
        proc.stop()


def test_every_dtype_crosses(models, run):
    from models import random_request

    async def main():
        async with Server() as server:
            server.add_model("all_dtypes", models["all_dtypes"])
            server.add_model("bf16", models["bf16"])
            remote, _ = await _linked(server)
            rng = np.random.default_rng(3)
            for name in ("all_dtypes", "bf16"):
                for rows in (1, 4000):  # inline, and (large enough) through shared memory
                    request = random_request(MODELS[name]["inputs"], rows, rng)
                    out = await remote.submit(name, request)
                    assert_matches(out, reference(name, request), f"{name} {rows}")
            remote.close()

    run(main)
