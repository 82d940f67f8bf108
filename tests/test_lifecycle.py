"""Versions of a model in one `serving.Server`: loading a new one while traffic flows,
unloading an old one, a load that fails, and what callers see meanwhile."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
from models import MODELS, assert_matches, mlp_params, until

import pxrt
from serving import Server, UnknownModel


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory):
    """The test MLP exported twice: version 1 and version 2 (other weights)."""
    root = tmp_path_factory.mktemp("versions")
    spec = MODELS["mlp"]
    paths = {}
    for version, seed in (("1", 0), ("2", 5)):
        paths[version] = pxrt.export(
            spec["fn"],
            mlp_params(seed=seed),
            root / f"v{version}",
            inputs=spec["inputs"],
            batch_buckets=spec["buckets"],
            name="mlp",
            version=version,
        )
    return paths


def _reference(seed, x):
    import jax

    return np.asarray(jax.jit(MODELS["mlp"]["fn"])(mlp_params(seed=seed), x)["y"])


def test_a_new_version_takes_over_without_a_failed_request(two_versions, run):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1 + i % 3, 32)).astype(np.float32) for i in range(40)]
    want = {v: [_reference(seed, x) for x in xs] for v, seed in (("1", 0), ("2", 5))}

    async def main():
        async with Server() as server:
            await server.load_model("mlp", two_versions["1"])
            answers = []  # (index, output) of every request, in completion order
            stop = asyncio.Event()

            async def caller(k):
                i = k
                while not stop.is_set():
                    out = await server.infer("mlp", {"x": xs[i % len(xs)]})
                    answers.append((i % len(xs), out["y"]))
                    i += 7

            callers = [asyncio.ensure_future(caller(k)) for k in range(8)]
            await until(lambda: len(answers) >= 16)  # traffic flows
            before = len(answers)
            await server.load_model("mlp", two_versions["2"])  # compiles while serving
            switched = len(answers)
            assert server.versions("mlp") == ["1", "2"]
            # Unversioned requests now reach version 2; version 1 by name.
            x = xs[0]
            np.testing.assert_allclose(
                (await server.infer("mlp", {"x": x}))["y"], want["2"][0], rtol=1e-5, atol=1e-5
            )
            old = await server.infer("mlp", {"x": x}, version="1")
            np.testing.assert_allclose(old["y"], want["1"][0], rtol=1e-5, atol=1e-5)
            await until(lambda: len(answers) >= switched + 16)  # both versions serve
            await server.unload_model("mlp", "1")  # answers what it accepted, then frees
            assert server.versions("mlp") == ["2"]
            with pytest.raises(UnknownModel, match="no version '1'"):
                await server.infer("mlp", {"x": x}, version="1")
            unloaded = len(answers)
            await until(lambda: len(answers) >= unloaded + 16)  # version 2 alone serves
            stop.set()
            await asyncio.gather(*callers)  # any failed request would raise here
            snap = server.metrics.snapshot_versions()
            return answers, before, switched, snap

    answers, before, switched, snap = run(main)
    assert before > 0 and len(answers) > switched
    # Every answer is one version's, whole. After the switch, version 1 answers only the
    # requests it had already accepted: at most one per caller (8).
    late_v1 = 0
    for n, (i, y) in enumerate(answers):
        ok = [v for v in ("1", "2") if np.allclose(y, want[v][i], rtol=1e-5, atol=1e-5)]
        assert ok, f"answer {n} matches no version"
        late_v1 += n >= switched and ok == ["1"]
    assert late_v1 <= 8
    assert all(
        np.allclose(y, want["2"][i], rtol=1e-5, atol=1e-5) for i, y in answers[switched + 8 :][-20:]
    )
    assert set(snap) == {("mlp", "2")} and snap[("mlp", "2")]["requests"]["success"] > 0


def test_a_failed_load_leaves_the_serving_version_alone(two_versions, tmp_path, run):
    broken = tmp_path / "broken"
    os.makedirs(broken)
    with open(os.path.join(two_versions["2"], "manifest.json")) as f:
        manifest = json.load(f)
    manifest["batch_buckets"] = "many"
    for name in ("model.jaxexport", "params.npz"):
        with open(os.path.join(two_versions["2"], name), "rb") as src:
            (broken / name).write_bytes(src.read())
    (broken / "manifest.json").write_text(json.dumps(manifest))
    x = np.ones((2, 32), np.float32)

    async def main():
        async with Server() as server:
            await server.load_model("mlp", two_versions["1"])
            with pytest.raises(pxrt.ArtifactError, match="batch_buckets"):
                await server.load_model("mlp", str(broken))
            assert server.versions("mlp") == ["1"]
            out = await server.infer("mlp", {"x": x})
            with pytest.raises(ValueError, match="version '1' of model 'mlp' is already"):
                await server.load_model("mlp", two_versions["1"])
            await server.unload_model("mlp")
            with pytest.raises(UnknownModel):
                await server.infer("mlp", {"x": x})
            with pytest.raises(UnknownModel):
                await server.unload_model("mlp")
            return out

    assert_matches(run(main), {"y": _reference(0, x)})


def test_unload_answers_every_accepted_request(two_versions, run):
    async def main():
        async with Server() as server:
            await server.load_model("mlp", two_versions["1"])
            xs = [np.full((1, 32), i, np.float32) for i in range(200)]
            pending = [server.infer("mlp", {"x": x}) for x in xs]  # queued, not awaited
            await server.unload_model("mlp")
            return xs, await asyncio.gather(*pending)

    xs, outs = run(main)
    for x, out in zip(xs[::20], outs[::20]):
        assert_matches(out, {"y": _reference(0, x)})


def test_an_unloaded_model_is_released(two_versions, run):
    import gc
    import weakref

    async def main():
        async with Server() as server:
            model = await server.load_model("mlp", two_versions["1"])
            ref, params = weakref.ref(model), weakref.ref(model.params_dev[0][0])
            await server.infer("mlp", {"x": np.ones((3, 32), np.float32)})
            del model
            await server.unload_model("mlp")
            return ref, params

    ref, params = run(main)
    gc.collect()
    # Nothing keeps the model, so its executables and device-resident params are freed.
    assert ref() is None and params() is None


def test_a_cancelled_unload_still_closes_its_version(two_versions, run):
    # The caller of unload_model stops waiting; the version still drains, its pipeline
    # stops, and Server.close (which may run meanwhile) waits for that closing.
    async def main():
        server = Server()
        await server.load_model("mlp", two_versions["1"])
        batcher = server._batcher("mlp")
        calls = []
        close = batcher.pipeline.close
        batcher.pipeline.close = lambda: (calls.append(1), close())[1]
        xs = [np.full((1, 32), i, np.float32) for i in range(50)]
        pending = [server.infer("mlp", {"x": x}) for x in xs]
        unload = asyncio.ensure_future(server.unload_model("mlp"))
        await asyncio.sleep(0)
        unload.cancel()
        await server.close()
        assert unload.cancelled() and batcher.pipeline._closed and calls == [1]
        assert server.metrics.versions == {}
        await batcher.close()  # closing again is a no-op
        return xs, await asyncio.gather(*pending), calls

    xs, outs, calls = run(main)
    assert calls == [1]
    for x, out in zip(xs[::10], outs[::10]):
        assert_matches(out, {"y": _reference(0, x)})


def test_an_http_request_is_answered_by_the_version_served_when_its_body_is_in(two_versions, run):
    # Version 1 serves when the request arrives; while its body trickles in, version 2
    # is loaded and version 1 unloaded. The request is answered by version 2, not failed.
    import httpx

    from serving.http.app import create_app

    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(1, 32)
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32],
                       "data": x.ravel().tolist()}]}  # fmt: skip
    body = json.dumps(doc).encode()

    async def main():
        async with Server() as server:
            await server.load_model("mlp", two_versions["1"])
            started, go = asyncio.Event(), asyncio.Event()

            async def trickle():
                yield body[:10]
                started.set()
                await go.wait()
                yield body[10:]

            async def switch():
                await started.wait()
                await server.load_model("mlp", two_versions["2"])
                await server.unload_model("mlp", "1")
                go.set()

            transport = httpx.ASGITransport(app=create_app(server))
            async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as http:
                r, _ = await asyncio.gather(
                    http.post("/v2/models/mlp/infer", content=trickle()), switch()
                )
            return r.status_code, r.json()

    status, doc = run(main)
    assert status == 200, doc
    assert doc["model_version"] == "2"
    out = np.asarray(doc["outputs"][0]["data"], np.float32).reshape(1, -1)
    np.testing.assert_allclose(out, _reference(5, x), rtol=1e-5, atol=1e-5)


def test_with_gc_frozen_a_loaded_model_joins_the_frozen_and_is_still_released(two_versions, run):
    # pxrt serve's policy (its on_models_changed hook): gc.freeze() after start-up, and a
    # model loaded later is frozen too (full collections skip it); unloading it still
    # frees it. A Server without the hook leaves the collector as it found it.
    import gc
    import weakref

    from serving.serve import refreeze_gc

    async def main(hook):
        async with Server(on_models_changed=hook) as server:
            model = await server.load_model("mlp", two_versions["1"])
            # gc.get_objects() lists the collector's generations, not the frozen ones.
            frozen = not any(o is model.engine for o in gc.get_objects())
            ref = weakref.ref(model)
            del model
            await server.infer("mlp", {"x": np.ones((2, 32), np.float32)})
            await server.unload_model("mlp")
            return frozen, ref

    gc.freeze()
    try:
        frozen, ref = run(main, refreeze_gc)
        plain_frozen, plain_ref = run(main, None)
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen and not plain_frozen
    assert ref() is None and plain_ref() is None


def test_statistics_are_per_version_over_http(two_versions, run):
    import httpx

    from serving.http.app import create_app

    async def main():
        async with Server() as server:
            await server.load_model("mlp", two_versions["1"])
            await server.load_model("mlp", two_versions["2"])
            for version, n in (("1", 3), ("2", 5)):
                for _ in range(n):
                    await server.infer("mlp", {"x": np.ones((1, 32), np.float32)}, version=version)
            transport = httpx.ASGITransport(app=create_app(server))
            async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as http:
                paths = ["/v2/models/mlp/versions/1/stats", "/v2/models/mlp/versions/2/stats",
                         "/v2/models/mlp/stats", "/v2/models/stats"]  # fmt: skip
                return [(await http.get(p)).json()["model_stats"] for p in paths]

    docs = run(main)
    got = [[(s["version"], s["inference_stats"]["success"]["count"]) for s in d] for d in docs]
    assert got == [[("1", 3)], [("2", 5)], [("2", 5)], [("2", 5)]]
