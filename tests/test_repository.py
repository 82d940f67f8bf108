"""The model repository (`<model>/<version>/`): version policies, control modes, and
`pxrt serve --model-repository` with its HTTP repository endpoints under load."""

from __future__ import annotations

import shutil
import threading

import httpx
import numpy as np
import pytest
from models import MODELS, mlp_params
from servers import ServeProcess

import pxrt
from serving import Server
from serving.engine.repository import Repository, RepositoryError, parse_policy


def _export(path, seed):
    spec = MODELS["mlp"]
    return pxrt.export(
        spec["fn"], mlp_params(seed=seed), path, inputs=spec["inputs"],
        batch_buckets=spec["buckets"], name="mlp", overwrite=True,
    )  # fmt: skip


def _want(seed, x):
    import jax

    return np.asarray(jax.jit(MODELS["mlp"]["fn"])(mlp_params(seed=seed), x)["y"])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Artifacts to copy into repositories: the test MLP with weights of seeds 1, 2, 3."""
    root = tmp_path_factory.mktemp("built")
    return {seed: _export(root / f"s{seed}", seed) for seed in (1, 2, 3)}


def _repo(tmp_path, built, versions):
    root = tmp_path / "repo"
    for v in versions:
        shutil.copytree(built[v], root / "mlp" / str(v))
    (root / "mlp" / "notes").mkdir()  # not a version: ignored
    return root


@pytest.mark.parametrize(
    "text, kind, arg",
    [("latest:2", "latest", 2), ("all", "all", None), ("specific:3,1", "specific", [1, 3])],
)
def test_version_policies_parse(text, kind, arg):
    assert parse_policy(text) == (kind, arg)


@pytest.mark.parametrize("bad", ["latest:0", "newest", "specific:", "all:3"])
def test_bad_version_policies_are_refused(bad):
    with pytest.raises(ValueError, match="expected latest:N"):
        parse_policy(bad)


def test_policies_and_polling(tmp_path, built, run):
    root = _repo(tmp_path, built, [1, 2])
    x = np.ones((1, 32), np.float32)

    async def main():
        async with Server() as server:
            repo = Repository(str(root), server, mode="poll", policies={"mlp": "latest:1"})
            await repo.start()
            assert server.versions("mlp") == ["2"]
            np.testing.assert_allclose((await server.infer("mlp", {"x": x}))["y"], _want(2, x),
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
            repo.policies = {"mlp": parse_policy("all")}
            assert await repo.sync("mlp") == ["1", "2"]
            shutil.copytree(built[3], root / "mlp" / "3")  # a new version appears
            repo.policies = {"mlp": parse_policy("latest:1")}
            assert await repo.sync("mlp") == ["3"]
            np.testing.assert_allclose((await server.infer("mlp", {"x": x}))["y"], _want(3, x),
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
            shutil.rmtree(root / "mlp" / "3")  # removed: the newest left takes over
            assert await repo.sync("mlp") == ["2"]
            broken = root / "mlp" / "4"
            shutil.copytree(built[1], broken)
            (broken / "params.npz").write_bytes(b"not the params")
            assert await repo.sync("mlp") == ["2"]  # the broken one failed; 2 still serves
            row = next(r for r in repo.index() if r["version"] == "4")
            assert row["state"] == "UNAVAILABLE" and "sha256" in row["reason"]
            assert {r["version"]: r["state"] for r in repo.index()}["2"] == "READY"

    run(main)


def test_modes(tmp_path, built, run):
    root = _repo(tmp_path, built, [1])

    async def main():
        async with Server() as server:
            none = Repository(str(root), server, mode="none")
            with pytest.raises(RepositoryError, match="control mode is none"):
                await none.load("mlp")
        async with Server() as server:
            explicit = Repository(str(root), server, mode="explicit")
            await explicit.start()
            assert server.models == {}
            assert [r["state"] for r in explicit.index()] == ["UNAVAILABLE"]
            await explicit.load("mlp")
            assert server.versions("mlp") == ["1"]
            with pytest.raises(RepositoryError, match="no model 'other'"):
                await explicit.load("other")
            await explicit.unload("mlp")
            assert server.models == {}
            with pytest.raises(RepositoryError, match="not loaded"):
                await explicit.unload("mlp")

    run(main)


ESCAPES = [
    "/abs/elsewhere",  # replaced by the absolute path of a model outside the repository
    "mlp/../../elsewhere",
    "../elsewhere",
    "/etc",
    "mlp/.",
    "mlp/./.",
    ".",
    "..",
    "",
    "mlp\\..",
    "m\x00lp",
    ".hidden",
    "link",  # a symlink in the repository to a model outside it
    "x" * 300,
]


def test_model_names_cannot_leave_the_repository(tmp_path, built, run):
    """Load and unload take one directory name of the repository, found by its scan:
    no absolute paths, no '..', no aliases of a model ('mlp/.'), no symlinks out."""
    root = _repo(tmp_path, built, [1])
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(built[2], elsewhere / "1")  # a valid model outside the repository
    (root / "link").symlink_to(elsewhere, target_is_directory=True)
    (root / "empty").mkdir()  # a directory without versions: not loadable either

    async def main():
        async with Server() as server:
            repo = Repository(str(root), server, mode="explicit")
            assert [r["name"] for r in repo.index()] == ["mlp"]  # not "link"
            for name in ESCAPES:
                name = str(elsewhere) if name == "/abs/elsewhere" else name
                with pytest.raises(RepositoryError):
                    await repo.load(name)
                with pytest.raises(RepositoryError):
                    await repo.unload(name)
                assert server.models == {}, name
            with pytest.raises(RepositoryError, match="no version to serve"):
                await repo.load("empty")
            # "/etc" exists and "nope" does not: both answer alike (no probing).
            errors = []
            for name in ("/etc", "/nope-nope"):
                with pytest.raises(RepositoryError) as info:
                    await repo.load(name)
                errors.append(str(info.value).replace(name, "NAME"))
            assert errors[0] == errors[1]
            await repo.load("mlp")
            assert server.versions("mlp") == ["1"] and list(server.models) == ["mlp"]

    run(main)


@pytest.mark.slow
def test_a_load_reloads_a_served_version_whose_files_changed(tmp_path, built, run):
    """Triton's reload: ``load`` of a version served whose files changed (exported again:
    the same sizes, a new manifest) loads them while the model it serves keeps serving,
    then swaps; every request is answered, by one or the other. Unchanged files: load
    changes nothing. Changed files that fail to load: load says so, the served stays."""
    import asyncio

    root = _repo(tmp_path, built, [1])
    x = np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)
    want = {seed: _want(seed, x) for seed in (1, 2)}

    async def main():
        async with Server() as server:
            repo = Repository(str(root), server, mode="explicit")
            assert await repo.load("mlp") == ["1"]
            first = server.model("mlp")
            assert await repo.load("mlp") == ["1"]
            assert server.model("mlp") is first  # the same files: nothing loaded
            shutil.rmtree(root / "mlp" / "1")
            shutil.copytree(built[2], root / "mlp" / "1")
            seen, stop = [], asyncio.Event()

            async def client():
                while not stop.is_set():
                    y = (await server.infer("mlp", {"x": x}))["y"]
                    seen.append(next(s for s in (1, 2) if np.allclose(y, want[s], atol=1e-5)))

            clients = [asyncio.ensure_future(client()) for _ in range(4)]
            assert await repo.load("mlp") == ["1"]
            answered_before = len(seen)
            while len(seen) < answered_before + 8:  # the new model answers too
                await asyncio.sleep(0.01)
            stop.set()
            await asyncio.gather(*clients)  # none failed
            assert server.model("mlp") is not first and server.versions("mlp") == ["1"]
            assert seen[-1] == 2 and set(seen) == {1, 2}, seen
            second = server.model("mlp")
            assert await repo.load("mlp") == ["1"]
            assert server.model("mlp") is second
            (root / "mlp" / "1" / "params.npz").write_bytes(b"not the params")
            with pytest.raises(RepositoryError, match=r"version 1: its changed files .*sha256"):
                await repo.load("mlp")
            assert server.model("mlp") is second
            assert [(r["version"], r["state"]) for r in repo.index()] == [("1", "READY")]
            np.testing.assert_allclose((await server.infer("mlp", {"x": x}))["y"], want[2],
                                       rtol=1e-5, atol=1e-5)  # fmt: skip

    run(main)


def test_reload_under_load_over_http(tmp_path, built):
    root = _repo(tmp_path, built, [1])
    proc = ServeProcess(
        ["--model-repository", str(root), "--model-control-mode", "explicit",
         "--load-model", "mlp"],
    )  # fmt: skip
    try:
        x = np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)
        want = {v: _want(v, x) for v in (1, 2)}
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32],
                            "data": x.ravel().tolist()}]}  # fmt: skip
        seen, failures, stop = [], [], threading.Event()

        def client():
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    r = c.post(proc.url + "/v2/models/mlp/infer", json=body)
                    if r.status_code != 200:
                        failures.append(r.text)
                        continue
                    y = np.array(r.json()["outputs"][0]["data"], np.float32).reshape(1, 32)
                    seen.append(next(v for v in (1, 2) if np.allclose(y, want[v], atol=1e-5)))

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        post = lambda path: httpx.post(proc.url + path, timeout=120)  # noqa: E731
        shutil.copytree(built[2], root / "mlp" / "2")
        assert post("/v2/repository/models/mlp/load").status_code == 200
        (root / "mlp" / "3").mkdir()
        shutil.copytree(built[1], root / "mlp" / "3", dirs_exist_ok=True)
        (root / "mlp" / "3" / "model.jaxexport").write_bytes(b"broken")
        bad = post("/v2/repository/models/mlp/load")  # 3 is broken: 2 keeps serving
        assert bad.status_code == 200, bad.text
        index = {r["version"]: r for r in post("/v2/repository/index").json()}
        assert index["2"]["state"] == "READY" and index["3"]["state"] == "UNAVAILABLE"
        assert "1" not in index or index["1"]["state"] != "READY"
        stop.set()
        for t in threads:
            t.join()
        assert not failures, failures[:3]
        assert seen and seen[-1] == 2 and set(seen) <= {1, 2}
        assert post("/v2/repository/models/mlp/unload").status_code == 200
        assert httpx.post(proc.url + "/v2/models/mlp/infer", json=body).status_code == 404
        again = post("/v2/repository/models/mlp/load")  # the policy picks 3: broken
        assert again.status_code == 400 and "failed to load: ArtifactError" in again.json()["error"]
        shutil.rmtree(root / "mlp" / "3")
        for name in ("%2E%2E", ".hidden", "mlp%5C..", "%2Fetc", "mlp%2F."):  # decoded by the server
            r = post(f"/v2/repository/models/{name}/load")
            assert r.status_code in (400, 404), (name, r.status_code, r.text)
        assert post("/v2/repository/models/mlp/load").status_code == 200
        meta = httpx.get(proc.url + "/v2/models/mlp").json()
        assert meta["versions"] == ["2"]
    finally:
        assert proc.stop() == 0


@pytest.mark.slow
def test_poll_mode_picks_up_new_and_removed_versions(tmp_path, built):
    import time

    root = _repo(tmp_path, built, [1])
    proc = ServeProcess(
        ["--model-repository", str(root), "--model-control-mode", "poll",
         "--repository-poll-secs", "0.3"]
    )  # fmt: skip

    def versions_become(want):
        deadline = time.time() + 60
        while time.time() < deadline:
            meta = httpx.get(proc.url + "/v2/models/mlp", timeout=10)
            if meta.status_code == 200 and meta.json()["versions"] == want:
                return True
            assert httpx.get(proc.url + "/v2/health/ready").status_code == 200
            time.sleep(0.1)
        return False

    try:
        assert versions_become(["1"])
        shutil.copytree(built[2], root / "mlp" / "2")
        assert versions_become(["2"])  # latest:1: 2 loaded, then 1 retired
        shutil.rmtree(root / "mlp" / "2")
        assert versions_become(["1"])
    finally:
        assert proc.stop() == 0


def test_polling_leaves_what_it_did_not_load_and_outlives_a_failed_scan(
    tmp_path, built, run, caplog
):
    root = _repo(tmp_path, built, [1])

    async def main():
        async with Server() as server:
            server.add_model("other", pxrt.load(built[2]))  # not from the repository
            repo = Repository(str(root), server, mode="poll", defaults={"max_batch_size": 2},
                              options={"late": {"max_batch_size": 4}})  # fmt: skip
            await repo.start()
            assert server.options("mlp").max_batch_size == 2  # the defaults apply
            shutil.copytree(root / "mlp", root / "late")  # a model added after start
            await repo.poll_once()
            assert server.options("late").max_batch_size == 4
            shutil.rmtree(root / "mlp")
            await repo.poll_once()
            assert sorted(server.models) == ["late", "other"]  # mlp retired, other kept
            moved = tmp_path / "moved"
            root.rename(moved)
            await repo.poll_once()  # the scan fails: logged, nothing changes
            assert sorted(server.models) == ["late", "other"]
            moved.rename(root)
            shutil.rmtree(root / "late")
            await repo.poll_once()  # and the next scan works
            assert sorted(server.models) == ["other"]

    run(main)
    assert "repository scan" in caplog.text


def test_polling_warns_once_per_broken_version_and_forgets_one_that_goes(
    tmp_path, built, run, caplog
):
    """A version that fails to load is tried (and warned of) again only once its
    directory changes, not on every poll; it leaves the index when its directory goes.
    Errors name the model as the client knows it (its directory), not its manifest."""
    root = _repo(tmp_path, built, [1])
    (root / "renamed").mkdir()
    shutil.copytree(built[1], root / "renamed" / "1")  # its manifest says "mlp"
    broken = root / "mlp" / "2"
    broken.mkdir()
    (broken / "manifest.json").write_text("{ not json")

    async def main():
        async with Server() as server:
            repo = Repository(str(root), server, mode="poll", policies={"mlp": "all"})
            with caplog.at_level("WARNING", logger="pxrt"):
                await repo.start()
                for _ in range(5):
                    await repo.poll_once()
            assert caplog.text.count("version 2 failed to load") == 1
            row = next(r for r in repo.index() if r["version"] == "2")
            assert row["state"] == "UNAVAILABLE"
            assert server.versions("mlp") == ["1"]
            (broken / "manifest.json").write_text("{ still not json }")  # it changes: again
            with caplog.at_level("WARNING", logger="pxrt"):
                await repo.poll_once()
                await repo.poll_once()
            assert caplog.text.count("version 2 failed to load") == 2
            shutil.rmtree(broken)
            await repo.poll_once()
            assert [r["version"] for r in repo.index() if r["name"] == "mlp"] == ["1"]
            # the model served as "renamed" is named so in its errors
            with pytest.raises(ValueError, match="model 'renamed': .*'x'") as caught:
                await server.infer("renamed", {"x": np.ones((1, 7), np.float32)})
            assert "'mlp'" not in str(caught.value)

    run(main)


def test_a_new_version_that_changes_the_inputs_is_refused_unless_allowed(tmp_path, built, run):
    """Version 2 takes other inputs than version 1, which clients use: it is not served
    (1 keeps serving, the index says why) until the model is allowed to change them."""
    root = _repo(tmp_path, built, [1])
    spec = MODELS["two_io"]
    pxrt.export(
        spec["fn"], spec["params"](), root / "mlp" / "2", inputs=spec["inputs"],
        batch_buckets=spec["buckets"], name="mlp",
    )  # fmt: skip

    async def main():
        async with Server() as server:
            repo = Repository(str(root), server, mode="poll")
            await repo.sync("mlp")  # start: 2 is the newest, nothing served yet: 2 loads
            assert server.versions("mlp") == ["2"]
            await repo.unload_all("mlp")
            shutil.move(root / "mlp" / "2", tmp_path / "v2")
            assert await repo.sync("mlp") == ["1"]
            shutil.move(tmp_path / "v2", root / "mlp" / "2")  # a new version appears
            assert await repo.sync("mlp") == ["1"]
            row = next(r for r in repo.index() if r["version"] == "2")
            assert row["state"] == "UNAVAILABLE"
            assert "differ from version 1's" in row["reason"] and "input 'x'" in row["reason"]
            allowed = Repository(str(root), server, mode="poll", allow_signature_change={"mlp"})
            assert await allowed.sync("mlp") == ["2"]

    run(main)


def test_names_from_the_directory_cannot_forge_log_lines(tmp_path, built, run, caplog):
    root = tmp_path / "repo"
    evil = root / "evil\npxrt: forged line"
    shutil.copytree(built[1], evil / "1")
    (evil / "1" / "params.npz").write_bytes(b"broken")

    async def main():
        async with Server() as server:
            await Repository(str(root), server, mode="poll").poll_once()

    with caplog.at_level("WARNING", logger="pxrt"):
        run(main)
    lines = [r.getMessage() for r in caplog.records if "failed to load" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines)
    assert "evil\\npxrt: forged line" in lines[0]
    # pxrt serve's own start-up lines too.
    proc = ServeProcess(["--model-repository", str(root)])
    try:
        output = proc.output()
    finally:
        assert proc.stop() == 0
    assert "evil\\npxrt: forged line version 1: UNAVAILABLE" in output
    assert not any(line.startswith("pxrt: forged line") for line in output.splitlines())


def test_decoders_in_the_repository(tmp_path, run):
    """A decoder artifact is a model like any other here: loaded by its policy (its newest
    wanted version: a decoder serves one at a time), READY in the index, left alone by
    later polls (not reloaded on every scan), replaced by a new version, unloaded."""
    from pxrt import demo

    built = demo.export_lm(
        str(tmp_path / "lm"), slots=2, max_length=32, prefill_lengths=(8,),
        prefill_batches=(1,), dim=16, heads=2, layers=1,
    )  # fmt: skip
    root = tmp_path / "repo"
    for v in (1, 2):
        shutil.copytree(built, root / "lm" / str(v))
    prompt = [5, 6, 7]

    async def main():
        async with Server() as server:
            repo = Repository(str(root), server, mode="poll", policies={"lm": "all"})
            await repo.start()
            assert await repo.sync("lm") == ["2"]
            first = server.decoder("lm")
            await repo.poll_once()
            await repo.poll_once()
            assert server.decoder("lm") is first  # not reloaded by the scans
            states = {r["version"]: r["state"] for r in repo.index() if r["name"] == "lm"}
            assert states == {"1": "UNAVAILABLE", "2": "READY"}
            want = first.generate(prompt, max_tokens=4).tokens
            got = [t async for t in server.generate("lm", prompt, max_tokens=4)]
            assert got == want
            shutil.copytree(built, root / "lm" / "3")
            await repo.poll_once()
            assert server.decoder("lm").version == "3" and server.decoder("lm") is not first
            shutil.rmtree(root / "lm")
            await repo.poll_once()
            assert not server.is_decoder("lm") and repo.index() == []

    run(main)
