"""pxrt.load + Model.run / run_batch against plain JAX, on however many devices jax has."""

from __future__ import annotations

import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from models import MODELS, assert_matches, random_request, reference

import pxrt

# How batches split over the devices, and the Cython modules end to end: `make test`
# also runs this module on one device with the pure-Python twins (PXRT_NO_EXTENSIONS=1).
pytestmark = [pytest.mark.devices, pytest.mark.twins]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_request_size_matches_jax(models, name):
    """Sizes 1 .. 2 x the largest bucket: padding, several chunks, split requests."""
    model = models[name]
    rng = np.random.default_rng(0)
    before = pxrt.compile_count()
    sizes = range(1, 2 * model.max_batch + 2)
    requests = [random_request(model.inputs, n, rng) for n in sizes]
    wants = [reference(name, r) for r in requests]
    start = pxrt.compile_count()
    for request, want in zip(requests, wants):
        assert_matches(model.run(request), want, f"{name} n={len(next(iter(request.values())))}")
    assert pxrt.compile_count() == start, "something compiled on the request path"
    assert model.compiles_after_load == 0
    assert before <= start


@pytest.mark.parametrize("name", list(MODELS))
def test_run_batch_matches_jax(models, name):
    model = models[name]
    rng = np.random.default_rng(1)
    sizes = [1, 3, model.max_batch, 2, model.max_batch + 3, 1, 2 * model.max_batch + 1]
    requests = [random_request(model.inputs, n, rng) for n in sizes]
    wants = [reference(name, r) for r in requests]
    outs = model.run_batch(requests)
    assert len(outs) == len(requests)
    for i, (got, want) in enumerate(zip(outs, wants)):
        assert_matches(got, want, f"{name}[{i}]")
    assert model.compiles_after_load == 0


def test_buckets_fit_the_devices(models):
    n = jax.device_count()
    for model in models.values():
        assert all(b % n == 0 for b in model.buckets)
        assert len(model.devices) == n
        # This jax is the one the fast path was verified on: every bucket uses it.
        assert all(model.bucket(b).fast_path for b in model.buckets)


def test_int64_survives_without_global_x64(models):
    assert not jax.config.jax_enable_x64
    model = models["all_dtypes"]
    req = random_request(model.inputs, 3, np.random.default_rng(5))
    req["i64"] = np.array([[2**31 + 5, -(2**40)]] * 3, np.int64)
    out = model.run(req)
    assert out["i64"].dtype == np.int64
    np.testing.assert_array_equal(out["i64"], req["i64"] + (2**31 + 5))
    assert not jax.config.jax_enable_x64


def test_bfloat16_model(models):
    model = models["bf16"]
    x = np.random.default_rng(2).standard_normal((5, 16)).astype(ml_dtypes.bfloat16)
    out = model.run({"x": x})
    assert list(out) == ["output"]
    assert out["output"].dtype == ml_dtypes.bfloat16
    assert_matches(out, reference("bf16", {"x": x}))


def test_outputs_are_read_only_views_unless_copied(models):
    model = models["mlp"]
    x = np.ones((1, 32), np.float32)
    view = model.run({"x": x})["y"]
    assert not view.flags.writeable
    owned = model.run({"x": x}, copy=True)["y"]
    assert owned.flags.writeable and owned.flags.owndata
    owned[:] = 0  # the caller may do what it likes with an owned copy
    np.testing.assert_array_equal(model.run({"x": x})["y"], view)


def test_outputs_outlive_later_runs(models):
    """A view handed out must not be overwritten by the next batches."""
    model = models["mlp"]
    rng = np.random.default_rng(3)
    kept = []
    for _ in range(3 * len(model.buckets) + 4):
        x = rng.standard_normal((int(rng.integers(1, model.max_batch + 1)), 32)).astype(np.float32)
        kept.append((model.run({"x": x})["y"], reference("mlp", {"x": x})))
    for got, want in kept:
        assert_matches({"y": got}, want)


def test_non_contiguous_and_reordered_inputs(models):
    model = models["two_io"]
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 50, (12, 5)).astype(np.int32)
    features = rng.standard_normal((8, 12)).astype(np.float16)
    cases = {
        "fortran": {"tokens": np.asfortranarray(tokens), "features": features.T},
        "strided rows": {"tokens": tokens[::2], "features": np.ascontiguousarray(features.T)[::2]},
        "reversed rows": {
            "tokens": tokens[::-1],
            "features": np.ascontiguousarray(features.T)[::-1],
        },
        "reordered keys": {"features": np.ascontiguousarray(features.T), "tokens": tokens},
        "broadcast rows": {
            "tokens": np.broadcast_to(tokens[:1], (6, 5)),
            "features": np.broadcast_to(features.T[:1], (6, 8)),
        },
    }
    for label, request in cases.items():
        want = reference("two_io", {k: np.ascontiguousarray(v) for k, v in request.items()})
        assert_matches(model.run(request), want, label)


def test_public_path_gives_the_same_results(artifacts, models):
    slow = pxrt.load(artifacts["two_io"], fast_path=False)
    assert not any(slow.bucket(b).fast_path for b in slow.buckets)
    rng = np.random.default_rng(6)
    for n in (1, 5, 9):
        request = random_request(slow.inputs, n, rng)
        assert_matches(slow.run(request), models["two_io"].run(request), f"n={n}")


def test_second_load_compiles_nothing(artifacts, models):
    """A second load runs the executables the first one stored: nothing is lowered,
    compiled or fetched."""
    from pxrt import _xla

    cache = pathlib.Path(pxrt.compiling.default_cache_dir())
    assert cache.is_dir() and any(cache.iterdir()), "the first load wrote no cache entries"
    compiles = _xla.compile_counter.total
    model = pxrt.load(artifacts["mlp"])
    assert {b.source for b in model.engine.buckets} == {"stored"}
    assert _xla.compile_counter.total == compiles  # (jax counts a cache fetch as one)
    x = np.ones((3, 32), np.float32)
    assert_matches(model.run({"x": x}), reference("mlp", {"x": x}))


def test_executables_jax_cannot_store_come_from_its_persistent_cache(tmp_path, monkeypatch):
    """An executable jax cannot serialize (pretended here) is marked so; later loads
    compile it through jax's persistent cache and then fetch it from there."""
    from models import mlp, mlp_params

    from pxrt import stored

    path = pxrt.export(
        mlp,
        mlp_params(width=20, seed=6),
        tmp_path / "mlp20",
        inputs={"x": pxrt.TensorSpec((20,), np.float32)},
        batch_buckets=(4, 8),
    )
    cache = str(tmp_path / "cache")
    monkeypatch.setattr(stored, "serializable", lambda compiled: False)
    first = pxrt.load(path, compilation_cache=cache)
    assert {b.source for b in first.engine.buckets} == {"compiled"}
    assert not list((tmp_path / "cache").glob(f"{stored.EXECUTABLES}/*"))
    pxrt.load(path, compilation_cache=cache)  # through jax's cache: written
    hits = []
    listener = lambda event, **kw: hits.append(event)  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    try:
        model = pxrt.load(path, compilation_cache=cache)
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert hits.count("/jax/compilation_cache/cache_hits") == len(model.buckets)
    assert {b.source for b in model.engine.buckets} == {"cache"}
    x = np.ones((5, 20), np.float32)
    want = {"y": np.asarray(jax.jit(mlp)(mlp_params(width=20, seed=6), x)["y"])}
    assert_matches(model.run({"x": x}), want)


def test_load_leaves_the_global_compilation_cache_alone(artifacts):
    before = jax.config.jax_compilation_cache_dir
    pxrt.load(artifacts["bf16"])
    assert jax.config.jax_compilation_cache_dir == before


def test_explicit_devices_and_buckets(artifacts):
    dev = jax.devices()[-1:]
    model = pxrt.load(artifacts["mlp"], devices=dev, buckets=(2, 5))
    assert model.buckets == (2, 5) and model.devices == dev
    x = np.random.default_rng(7).standard_normal((11, 32)).astype(np.float32)
    out = model.run({"x": x})
    assert_matches(out, reference("mlp", {"x": x}))


def test_describe_reports_buckets(models):
    info = models["mlp"].describe()
    assert [b["bucket"] for b in info["buckets"]] == list(models["mlp"].buckets)
    assert all(b["flops"] > 0 for b in info["buckets"])
    assert info["manifest"]["name"] == "mlp"


def test_compile_counter_catches_a_compile_on_the_request_path(artifacts):
    """The guard behind `compiles_after_load == 0` can fail: force a compile inside run."""
    model = pxrt.load(artifacts["mlp"])

    class Compiling:
        def __init__(self, real):
            self.real = real
            self.path = real.path
            self.out_shard_rows, self.row_slices = real.out_shard_rows, real.row_slices

        def dispatch(self, slot):
            jax.jit(lambda v: v * 3.0)(np.float32(len(slot.buffers)))  # a fresh jit compiles
            return self.real.dispatch(slot)

        def fetch(self, handle):
            return self.real.fetch(handle)

    model.engine = model.engine.replace_programs(Compiling)
    x = np.ones((model.max_batch, 32), np.float32)
    model.run({"x": x})
    assert model.compiles_after_load == 1
    model.run_batch([{"x": x}])
    assert model.compiles_after_load == 2  # a new lambda each call: run_batch compiled too


@pytest.mark.parametrize("zero_copy", [True, False])
def test_concurrent_callers_get_their_own_answers(artifacts, zero_copy):
    """Threads share one model (and its staging rings, deeper than the ring)."""
    import threading

    model = pxrt.load(artifacts["mlp"], zero_copy=zero_copy, staging_depth=2)
    rng = np.random.default_rng(8)
    requests = [
        {"x": rng.standard_normal((int(rng.integers(1, 20)), 32)).astype(np.float32)}
        for _ in range(120)
    ]
    wants = [reference("mlp", r) for r in requests]
    got: dict[int, dict] = {}
    errors: list[BaseException] = []

    def worker(start):
        try:
            for i in range(start, len(requests), 6):
                got[i] = model.run(requests[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, want in enumerate(wants):
        assert_matches(got[i], want, f"request {i}")
    for size in model.buckets:
        ring = model.bucket(size).ring
        assert ring.slots_made <= 2 and ring.slots_free == ring.slots_made


def test_every_output_is_read_only_unless_copied(models):
    """Views, copies across device shards, and requests split across chunks alike."""
    model = models["mlp"]
    x = np.ones((3 * model.max_batch + 1, 32), np.float32)
    for rows in (1, model.max_batch, 3 * model.max_batch + 1):
        assert not model.run({"x": x[:rows]})["y"].flags.writeable
        assert model.run({"x": x[:rows]}, copy=True)["y"].flags.writeable


def test_cells_compiled_one_at_a_time_or_in_parallel_serve_alike(artifacts, models):
    """``compile_workers``: the cells compile on a pool (default: a thread per core);
    one at a time gives the same model."""
    one = pxrt.load(artifacts["two_io"], compile_workers=1)
    assert one.buckets == models["two_io"].buckets
    rng = np.random.default_rng(8)
    for n in (1, 3, 7):
        request = random_request(one.inputs, n, rng)
        assert_matches(one.run(request), models["two_io"].run(request), f"n={n}")
    with pytest.raises(ValueError, match="compile_workers must be an int >= 1"):
        pxrt.load(artifacts["two_io"], compile_workers=0)


def test_warm_loads_reuse_measured_cell_times_and_refuse_bad_entries(
    artifacts, tmp_path, monkeypatch
):
    """A cell's execution time and the path its fast-path check proved are found once
    per machine, program and cell and stored beside the compiled executables: a warm
    load reads them (no timing runs, no comparison with the public path: one warm-up
    run per cell); an entry whose bytes do not check out is found again and rewritten."""
    import json

    from pxrt import _xla

    cache = tmp_path / "cache"
    first = pxrt.load(artifacts["mlp"], compilation_cache=str(cache))
    n = len(first.engine.buckets)
    entries = {
        kind: sorted(
            p
            for p in (cache / "timings").glob("*.json")
            if kind in json.loads(p.read_text())["value"]
        )
        for kind in ("exec_s", "path")
    }
    assert len(entries["exec_s"]) == len(entries["path"]) == n
    runs, timed = [], []
    real_run, real_time = _xla.run_program, _xla.time_program
    monkeypatch.setattr(_xla, "run_program", lambda *a: runs.append(1) or real_run(*a))
    monkeypatch.setattr(_xla, "time_program", lambda *a: timed.append(1) or real_time(*a))
    warm = pxrt.load(artifacts["mlp"], compilation_cache=str(cache))
    assert not timed and len(runs) == n  # one warm-up run per cell
    assert [b.exec_s for b in warm.engine.buckets] == [b.exec_s for b in first.engine.buckets]
    assert [b.program.path for b in warm.engine.buckets] == [
        b.program.path for b in first.engine.buckets
    ]
    tampered = {}
    for kind, change in (("exec_s", lambda v: v * 100), ("path", lambda v: "raw!")):
        doc = json.loads(entries[kind][0].read_text())
        doc["value"][kind] = tampered[kind] = change(doc["value"][kind])  # its check fails
        entries[kind][0].write_text(json.dumps(doc))
    runs.clear()
    pxrt.load(artifacts["mlp"], compilation_cache=str(cache))
    assert len(timed) == 1 and len(runs) > n  # measured and proven again
    for kind in ("exec_s", "path"):  # and rewritten soundly
        assert json.loads(entries[kind][0].read_text())["value"][kind] != tampered[kind]
    x = np.ones((3, 32), np.float32)
    assert_matches(warm.run({"x": x}), reference("mlp", {"x": x}))


def test_warm_loads_run_stored_executables_and_refuse_bad_ones(tmp_path, monkeypatch):
    """The executables a load compiles are stored; a warm load loads them without
    lowering, compiling or fetching from jax's persistent cache. One whose bytes do not
    check out, or that was stored under another key, is refused and compiled afresh
    (and stored again). The fast-path check runs on the cold load only."""
    from models import mlp, mlp_params

    from pxrt import _xla

    # A program of this test's own, so that its first load really compiles.
    path = pxrt.export(
        mlp,
        mlp_params(width=24, seed=5),
        tmp_path / "mlp24",
        inputs={"x": pxrt.TensorSpec((24,), np.float32)},
        batch_buckets=(1, 4, 8, 16),  # 3 cells on 4 devices
    )
    cache = tmp_path / "cache"
    checks = []
    real_make = _xla.make_program
    monkeypatch.setattr(
        _xla, "make_program", lambda *a, **k: checks.append(1) or real_make(*a, **k)
    )
    compiles = _xla.compile_counter.total
    cold = pxrt.load(path, compilation_cache=str(cache))
    assert {b.source for b in cold.engine.buckets} == {"compiled"}
    assert _xla.compile_counter.total - compiles == len(cold.engine.buckets)
    assert len(checks) == len(cold.engine.buckets) and cold.load_phases["time"] > 0
    stored_files = sorted((cache / "executables").glob("*.bin"))
    assert len(stored_files) == len(cold.engine.buckets)

    compiles = _xla.compile_counter.total
    warm = pxrt.load(path, compilation_cache=str(cache))
    assert {b.source for b in warm.engine.buckets} == {"stored"}
    assert _xla.compile_counter.total == compiles
    assert len(checks) == len(cold.engine.buckets) and warm.load_phases["time"] == 0
    assert [b.program.path for b in warm.engine.buckets] == [
        b.program.path for b in cold.engine.buckets
    ]
    rng = np.random.default_rng(3)
    for n in (1, 3, 8, 11):
        x = rng.standard_normal((n, 24)).astype(np.float32)
        want = {"y": np.asarray(jax.jit(mlp)(mlp_params(width=24, seed=5), x)["y"])}
        assert_matches(warm.run({"x": x}), want, f"n={n}")
    assert warm.compiles_after_load == 0

    # One flipped byte; one entry swapped for another cell's (a foreign entry).
    flipped = bytearray(stored_files[0].read_bytes())
    flipped[-100] ^= 0xFF
    stored_files[0].write_bytes(bytes(flipped))
    stored_files[1].write_bytes(stored_files[2].read_bytes())
    compiles = _xla.compile_counter.total
    again = pxrt.load(path, compilation_cache=str(cache))
    sources = [b.source for b in again.engine.buckets]
    assert sources.count("compiled") == 2 and sources.count("stored") == len(sources) - 2
    assert _xla.compile_counter.total - compiles == 2
    x = rng.standard_normal((5, 24)).astype(np.float32)
    want = {"y": np.asarray(jax.jit(mlp)(mlp_params(width=24, seed=5), x)["y"])}
    assert_matches(again.run({"x": x}), want)
    assert {b.source for b in pxrt.load(path, compilation_cache=str(cache)).engine.buckets} == {
        "stored"
    }  # stored again

    # Executables that load but do not run (one fetched from jax's persistent cache
    # serializes without its native code): compiled afresh, and stored again.
    import shutil

    from pxrt import stored

    shutil.rmtree(cache / stored.EXECUTABLES)
    with pytest.MonkeyPatch.context() as patch:  # take jax's cached ones as they are
        patch.setattr(stored, "unstorable", lambda cache_dir, k: True)
        pxrt.load(path, compilation_cache=str(cache))  # (fills jax's cache)
        fetched = pxrt.load(path, compilation_cache=str(cache))
    assert {b.source for b in fetched.engine.buckets} == {"cache"}
    art = pxrt.read_artifact(path)
    for b in fetched.engine.buckets:
        k = stored.key(art, fetched.devices, b.size, b.lengths, "executable", True)
        assert stored.store_executable(str(cache), k, b.compiled)
    healed = pxrt.load(path, compilation_cache=str(cache))
    assert {b.source for b in healed.engine.buckets} == {"compiled"}
    assert_matches(healed.run({"x": x}), want)


class _Planted:
    """Unpickling it creates ``path``: what a planted cache entry could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_stored_entries_are_trusted_only_from_a_safe_directory_with_our_key(artifacts, tmp_path):
    """Stored executables are pickles (jax's format): one planted by anyone without the
    cache's per-user key (a copied cache, a file written where others could) is never
    unpickled, whatever its checksum; a cache under a directory others can write to, or
    whose folders are symlinks out of it, is not used."""
    import hashlib
    import os
    import pickle
    import warnings

    from pxrt import stored

    cache = tmp_path / "cache"
    first = pxrt.load(artifacts["mlp"], compilation_cache=str(cache))
    art = pxrt.read_artifact(artifacts["mlp"])
    marker = tmp_path / "unpickled"
    for b in first.engine.buckets:
        k = stored.key(art, first.devices, b.size, b.lengths, "executable", True)
        payload = pickle.dumps(_Planted(str(marker)))
        plain = hashlib.sha256(k.encode() + b":" + payload).hexdigest()  # (a plain checksum)
        (cache / stored.EXECUTABLES / f"{k}.bin").write_bytes(
            stored._MAGIC + plain.encode() + b"\n" + payload
        )
    again = pxrt.load(artifacts["mlp"], compilation_cache=str(cache))
    assert not marker.exists()
    assert (cache / stored.KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert {b.source for b in again.engine.buckets} <= {"compiled", "cache"}
    x = np.ones((3, 32), np.float32)
    assert_matches(again.run({"x": x}), reference("mlp", {"x": x}))

    # A directory above the cache that others can write to (and not /tmp's sticky kind).
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.warns(RuntimeWarning, match="a directory above it, belongs to another user"):
        model = pxrt.load(artifacts["mlp"], compilation_cache=str(shared / "cache"))
    assert model._cache_dir is None
    # A folder of the cache that is a symlink out of it: nothing read there or written.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(elsewhere, linked / stored.EXECUTABLES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pxrt.load(artifacts["mlp"], compilation_cache=str(linked))
    assert not list(elsewhere.iterdir())


def test_the_cache_key_is_made_once_whoever_asks_first(tmp_path):
    """A cold load's compile threads ask for the cache's key at once: all get the same
    whole key (one used to read the file half-written, and nothing was stored)."""
    import concurrent.futures

    from pxrt import stored

    for i in range(5):
        cache = stored.safe_cache_dir(str(tmp_path / f"c{i}"))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            keys = list(pool.map(stored._hmac_key, [cache] * 8))
        assert len(set(keys)) == 1 and len(keys[0]) == 32


def test_a_load_that_would_not_fit_in_memory_is_refused_before_compiling(artifacts, monkeypatch):
    from pxrt import _xla, compiling

    monkeypatch.setattr(compiling, "available_host_bytes", lambda: 4 << 10)
    compiles = _xla.compile_counter.total
    with pytest.raises(ValueError, match=r"'mlp' needs about .* MiB of host memory .* cells x 3"):
        pxrt.load(artifacts["mlp"])
    assert _xla.compile_counter.total == compiles
    monkeypatch.setattr(compiling, "available_host_bytes", lambda: None)  # unknown: load
    assert pxrt.load(artifacts["mlp"], buckets=(4,)).buckets


def test_remeasure_times_again_what_an_earlier_load_measured(artifacts, tmp_path):
    """A warm load's cell times are an earlier load's; ``remeasure`` times them again
    (when ``idle()`` allows), and stores the new times."""
    from pxrt import stored

    cache = str(tmp_path / "cache")
    cold = pxrt.load(artifacts["mlp"], compilation_cache=cache)
    assert not cold.stale_cells
    warm = pxrt.load(artifacts["mlp"], compilation_cache=cache)
    assert len(warm.stale_cells) == len(warm.engine.buckets)
    assert warm.remeasure(idle=lambda: False) == 0
    assert len(warm.stale_cells) == len(warm.engine.buckets)
    first = warm.stale_cells[0]
    # Work that came while a cell was being timed: its time is dropped, the cell stays.
    answers = iter([True, False])
    assert warm.remeasure(idle=lambda: next(answers)) == 0
    assert len(warm.stale_cells) == len(warm.engine.buckets) and first.timed == "stored"
    before = first.exec_s
    assert warm.remeasure(most=1) == 1 and first.timed == "measured"
    assert stored.stored_time(cache, warm._timing_key(first)) == first.exec_s
    assert first.exec_s != before  # (a median of fresh runs; equal to the ns is chance)
    assert warm.remeasure() == len(warm.engine.buckets) - 1 and not warm.stale_cells
    x = np.ones((3, 32), np.float32)
    assert_matches(warm.run({"x": x}), reference("mlp", {"x": x}))
