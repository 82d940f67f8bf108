"""pxrt.load + Model.run / run_batch against plain JAX, on however many devices jax has."""

from __future__ import annotations

import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from models import MODELS, assert_matches, random_request, reference

import pxrt


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


def test_second_load_uses_the_compilation_cache(artifacts, models):
    cache = pathlib.Path(pxrt.executable.default_cache_dir())
    assert cache.is_dir() and any(cache.iterdir()), "the first load wrote no cache entries"
    hits = []
    listener = lambda event, **kw: hits.append(event)  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    try:
        model = pxrt.load(artifacts["mlp"])
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert hits.count("/jax/compilation_cache/cache_hits") == len(model.buckets)
    x = np.ones((3, 32), np.float32)
    assert_matches(model.run({"x": x}), reference("mlp", {"x": x}))


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
