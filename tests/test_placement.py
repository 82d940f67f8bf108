"""Placement: one program sharded over the devices, or instances of the model each on its
own devices (``pxrt.load(placement=...)``), and ``auto`` choosing by measured
throughput. Run with one device and with four virtual ones (the Makefile does both)."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import jax
import numpy as np
import pytest
from models import (
    assert_matches,
    encoder_reference,
    random_request,
    reference,
)

import pxrt
from pxrt.dispatch import Engine
from serving import Server

# How batches split over the devices: `make test` also runs this module on one device
# (with the pure-Python twins).
pytestmark = [pytest.mark.devices]

N = jax.device_count()


def _device_sets():
    """The device counts to load on: 1, 2 and 4 where there are that many."""
    return [k for k in (1, 2, 4) if k <= N]


@pytest.fixture(scope="module")
def placed(artifacts):
    """(devices, placement) -> the mlp loaded so; instances of 2 devices on 4."""
    out = {}
    for k in _device_sets():
        devices = jax.devices()[:k]
        for placement in ("sharded", "replicated"):
            out[(k, placement)] = pxrt.load(artifacts["mlp"], devices=devices, placement=placement)
    if N >= 4:
        out[(4, "2x2")] = pxrt.load(
            artifacts["mlp"], devices=jax.devices()[:4], placement="replicated", instances=2
        )
    return out


def test_every_placement_matches_plain_jax(placed):
    rng = np.random.default_rng(0)
    for (k, how), model in placed.items():
        per = 2 if how == "2x2" else (1 if how == "replicated" else k)
        assert len(model.instances) == k // per and all(len(g) == per for g in model.instances)
        assert model.placement == ("sharded" if k // per == 1 else "replicated")
        for rows in (1, 3, 8, 16, 37):
            request = random_request(model.inputs, rows, rng)
            assert_matches(model.run(request), reference("mlp", request), f"{k} {how} n={rows}")
        requests = [random_request(model.inputs, int(n), rng) for n in rng.integers(1, 20, 12)]
        for got, request in zip(model.run_batch(requests), requests):
            assert_matches(got, reference("mlp", request), f"{k} {how} batch")
        assert model.compiles_after_load == 0


def test_instances_of_a_model_with_named_dimensions(var_artifacts):
    from pxrt import demo

    model = pxrt.load(var_artifacts["encoder"], placement="replicated")
    assert len(model.instances) == N
    for rows, length in ((1, 5), (3, 16), (6, 30)):
        request = demo.encoder_request(rows, length, seed=rows, vocab=64)
        assert_matches(model.run(request), encoder_reference(request), f"{rows}x{length}")


def test_batches_spread_over_the_instances_and_a_bad_request_fails_alone(run, placed):
    model = placed[(N, "replicated")]
    rng = np.random.default_rng(1)
    good = [random_request(model.inputs, int(n), rng) for n in rng.integers(1, 12, 200)]
    before = list(model.engine.instance_batches)

    async def main():
        async with Server() as server:
            server.add_model("mlp", model, max_delay_us=0)
            bad = server.infer("mlp", {"x": np.ones((2, 31), np.float32)})
            results = await asyncio.gather(
                bad, *(server.infer("mlp", r) for r in good), return_exceptions=True
            )
            return results

    results = run(main)
    assert isinstance(results[0], ValueError) and "'x'" in str(results[0])
    for got, request in zip(results[1:], good):
        assert_matches(got, reference("mlp", request))
    ran = [a - b for a, b in zip(model.engine.instance_batches, before)]
    if N > 1:
        assert all(n > 0 for n in ran), ran  # every instance took batches


class _Failing:
    """One instance's program that fails every batch."""

    def __init__(self, real):
        self.path, self.row_slices = real.path, real.row_slices
        self.out_shard_rows = real.out_shard_rows

    def dispatch(self, slot):
        raise RuntimeError("injected failure of instance 1")

    def fetch(self, handle):  # pragma: no cover - dispatch raised
        raise AssertionError


@pytest.mark.skipif(N < 2, reason="needs two devices")
def test_an_instance_that_fails_fails_only_its_batches(run, artifacts):
    model = pxrt.load(artifacts["mlp"], devices=jax.devices()[:2], placement="replicated")
    real = model.engine
    buckets = [
        dataclasses.replace(b, programs=(b.programs[0], _Failing(b.programs[1])))
        for b in real.buckets
    ]
    model.engine = Engine(real.name, real.input_handler, real.result_handler, buckets, model)
    rng = np.random.default_rng(2)
    requests = [random_request(model.inputs, 3, rng) for _ in range(60)]

    async def main():
        async with Server() as server:
            server.add_model("mlp", model, max_delay_us=0, max_batch_size=4)
            first = await asyncio.gather(
                *(server.infer("mlp", r) for r in requests), return_exceptions=True
            )
            after = await asyncio.gather(  # still serving
                *(server.infer("mlp", r) for r in requests[:20]), return_exceptions=True
            )
            return first, after

    first, after = run(main)
    failed = [r for r in first if isinstance(r, Exception)]
    ok = [(g, r) for g, r in zip(first, requests) if not isinstance(g, Exception)]
    assert failed and ok, (len(failed), len(ok))
    assert all("injected failure of instance 1" in str(e) for e in failed)
    for got, request in ok:
        assert_matches(got, reference("mlp", request))
    assert all(n > 0 for n in model.engine.instance_batches)
    assert any(isinstance(g, dict) for g in after)


def test_drain_answers_every_request_across_instances(run, placed):
    from models import inject

    model = placed[(N, "replicated")]
    rng = np.random.default_rng(3)
    requests = [random_request(model.inputs, int(n), rng) for n in rng.integers(1, 9, 40)]

    async def main():
        with inject(model, hold=True) as gate:
            server = Server()
            server.add_model("mlp", model, max_delay_us=0)
            calls = [asyncio.ensure_future(server.infer("mlp", r)) for r in requests]
            await gate.wait_started()
            cancelled = calls[-1]
            cancelled.cancel()
            closing = asyncio.ensure_future(server.close())
            await asyncio.sleep(0)
            gate.release.set()
            await closing
            return calls

    calls = run(main)
    for call, request in zip(calls[:-1], requests):
        assert_matches(call.result(), reference("mlp", request))
    assert calls[-1].cancelled()


def test_auto_measures_every_candidate_and_stores_its_choice(artifacts, tmp_path):
    cache = str(tmp_path / "cache")
    model = pxrt.load(artifacts["mlp"], placement="auto", compilation_cache=cache)
    x = np.ones((5, 32), np.float32)
    assert_matches(model.run({"x": x}), reference("mlp", {"x": x}))
    if N == 1:
        assert model.placement == "sharded" and "one device" in model.placement_reason
        return
    reason = model.placement_reason
    assert "rows/s" in reason and "(measured)" in reason
    # The one program, then instances from one per device halving down to one.
    counts = [N >> i for i in range(N.bit_length())]
    assert f"one program over {N} devices " in reason
    for k in counts:
        assert f"{k} instance{'s' if k > 1 else ''} of 1 device " in reason
    assert "placement" in model.load_phases
    chosen = len(model.instances)
    assert model.placement == ("sharded" if len(model.instances[0]) == N else "replicated")
    assert reason.startswith(
        f"placement='auto' chose one program over {N} devices"
        if model.placement == "sharded"
        else f"placement='auto' chose {chosen} instance"
    )
    # The probe's cell was timed by this load: not a time to measure again.
    assert not model.stale_cells
    again = pxrt.load(artifacts["mlp"], placement="auto", compilation_cache=cache)
    assert again.instances == model.instances and "(stored)" in again.placement_reason
    info = again.describe()
    assert info["placement"] == again.placement and len(info["instances"]) == len(again.instances)


def _auto_with_rates(artifacts, monkeypatch, rates, **options):
    """``placement="auto"`` with each candidate's throughput given: ``rates`` maps
    (instances, devices per instance) -> rows/s. Returns the model and the candidates
    that were measured."""
    from pxrt import executable

    seen = []

    def throughput(model, rows, seconds):
        key = (len(model.instances), len(model.instances[0]))
        seen.append(key)
        return rates[key]

    monkeypatch.setattr(executable, "_throughput", throughput)
    model = pxrt.load(artifacts["mlp"], placement="auto", compilation_cache=False, **options)
    return model, sorted(set(seen))


@pytest.mark.skipif(N < 4, reason="needs four devices")
def test_auto_prefers_the_one_program_then_fewer_instances_unless_faster_by_the_margin(
    artifacts, monkeypatch
):
    sharded = (1, 4)
    # Instances within the margin of the one program: the one program.
    model, seen = _auto_with_rates(
        artifacts, monkeypatch, {sharded: 100, (4, 1): 104, (2, 1): 90, (1, 1): 50}
    )
    assert seen == [(1, 1), (1, 4), (2, 1), (4, 1)]
    assert model.placement == "sharded" and len(model.instances) == 1
    assert "chose one program over 4 devices" in model.placement_reason
    # Fewer instances within the margin of more: the fewer.
    model, _ = _auto_with_rates(
        artifacts, monkeypatch, {sharded: 100, (4, 1): 210, (2, 1): 205, (1, 1): 50}
    )
    assert model.placement == "replicated"
    assert [len(g) for g in model.instances] == [1, 1]
    assert "chose 2 instances of 1 device" in model.placement_reason
    # One device alone, when it is the fastest by the margin.
    model, _ = _auto_with_rates(
        artifacts, monkeypatch, {sharded: 100, (4, 1): 120, (2, 1): 125, (1, 1): 140}
    )
    assert model.placement == "replicated" and model.instances == [[jax.devices()[0]]]
    x = np.ones((3, 32), np.float32)
    assert_matches(model.run({"x": x}), reference("mlp", {"x": x}))
    # instances given: just that count against the one program.
    model, seen = _auto_with_rates(artifacts, monkeypatch, {sharded: 100, (2, 2): 150}, instances=2)
    assert seen == [(1, 4), (2, 2)]
    assert model.placement == "replicated" and [len(g) for g in model.instances] == [2, 2]
    # One instance of every device: nothing to choose, nothing measured.
    model, seen = _auto_with_rates(artifacts, monkeypatch, {}, devices_per_instance=4)
    assert seen == [] and model.placement == "sharded"
    assert "one instance is all the devices allow" in model.placement_reason


@pytest.mark.skipif(N < 2, reason="needs two devices")
def test_auto_skips_a_candidate_that_would_not_fit(artifacts, monkeypatch):
    from pxrt import compiling

    real = compiling.check_memory

    def check(art, cells, devices, depth, instances=1):
        if instances > 1:
            raise ValueError("would not fit")
        return real(art, cells, devices, depth, instances)

    monkeypatch.setattr(compiling, "check_memory", check)
    rates = {(1, N): 100, (1, 1): 90}
    model, seen = _auto_with_rates(artifacts, monkeypatch, {**rates, (N, 1): 1e9, (2, 1): 1e9})
    assert seen == sorted(rates)  # only the candidates that fit were measured
    assert model.placement == "sharded"
    assert f"{N} instances" not in model.placement_reason


def test_the_default_placement_is_auto_unless_pxrt_placement_says(artifacts, monkeypatch):
    monkeypatch.delenv("PXRT_PLACEMENT")  # (conftest fixes it for the other tests)
    model = pxrt.load(artifacts["mlp"], compilation_cache=False)
    assert model.placement_reason.startswith("placement='auto'")
    monkeypatch.setenv("PXRT_PLACEMENT", "replicated")
    model = pxrt.load(artifacts["mlp"])
    assert len(model.instances) == N and all(len(g) == 1 for g in model.instances)
    assert model.placement == ("replicated" if N > 1 else "sharded")
    monkeypatch.setenv("PXRT_PLACEMENT", "spread")
    with pytest.raises(ValueError, match="PXRT_PLACEMENT must be one of sharded, replicated"):
        pxrt.load(artifacts["mlp"])
    # Given, it wins over the environment.
    assert pxrt.load(artifacts["mlp"], placement="sharded").placement == "sharded"


def test_placement_options_are_checked(artifacts):
    with pytest.raises(ValueError, match="placement must be one of sharded, replicated, auto"):
        pxrt.load(artifacts["mlp"], placement="spread")
    with pytest.raises(ValueError, match="instances must be an int >= 1"):
        pxrt.load(artifacts["mlp"], placement="replicated", instances=0)
    with pytest.raises(ValueError, match="placement='sharded' runs one instance"):
        pxrt.load(artifacts["mlp"], instances=2)
    with pytest.raises(ValueError, match=f"need {2 * (N + 1)} devices; {N} given"):
        pxrt.load(artifacts["mlp"], placement="replicated", instances=N + 1, devices_per_instance=2)


@pytest.mark.skipif(N < 2, reason="needs two devices")
def test_memory_is_counted_per_instance(artifacts, monkeypatch):
    from pxrt import compiling

    one = []
    monkeypatch.setattr(compiling, "available_host_bytes", lambda: one.append(1) or None)
    # The need of N instances is above what one instance needs.
    needs = []
    real = compiling.check_memory

    def spy(art, cells, devices, depth, instances=1):
        needs.append(instances)
        return real(art, cells, devices, depth, instances)

    monkeypatch.setattr(compiling, "check_memory", spy)
    pxrt.load(artifacts["mlp"], placement="replicated")
    assert needs == [N]
    monkeypatch.setattr(compiling, "available_host_bytes", lambda: 64 << 10)
    monkeypatch.setattr(compiling, "check_memory", real)
    with pytest.raises(ValueError, match=rf"x {N} instances\) and"):
        pxrt.load(artifacts["mlp"], placement="replicated")


def test_instance_batches_are_a_metric(run, placed):
    from prometheus_client import generate_latest

    model = placed[(N, "replicated")]
    x = np.ones((2, 32), np.float32)

    async def main():
        async with Server() as server:
            server.add_model("mlp", model, max_delay_us=0)
            await asyncio.gather(*(server.infer("mlp", {"x": x}) for _ in range(20)))
            return generate_latest(server.metrics.registry).decode()

    page = run(main)
    if N > 1:
        for i in range(N):
            assert f'pxrt_instance_batches_total{{instance="{i}",model="mlp",version="1"}}' in page
    else:
        assert "pxrt_instance_batches_total{" not in page


def _serve_args(*argv):
    import argparse

    from serving.config import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_serve_flags_and_toml_set_the_placement(tmp_path):
    from serving.config import model_specs, repository_config
    from serving.options import Placement

    args = _serve_args("--instances", "2", str(tmp_path / "m"))
    [(_, _, _, place)] = model_specs(args, str(tmp_path))
    assert place == Placement("replicated", 2) and place.load_options() == {
        "placement": "replicated",
        "instances": 2,
    }
    conf = tmp_path / "serve.toml"
    conf.write_text(
        "[defaults]\nplacement = 'auto'\n"
        "[models.a]\npath = 'x'\ninstance_group = [{count = 1, kind = 'KIND_GPU'}]\n"
        "[models.b]\npath = 'y'\ndevices_per_instance = 2\n"
        "[models.c]\ninstance_group = [{kind = 'KIND_MODEL'}]\n"
    )
    args = _serve_args("--config", str(conf), "--model-repository", str(tmp_path))
    specs = {name: place for name, _, _, place in model_specs(args, str(tmp_path))}
    assert specs == {
        "a": Placement("replicated"),
        "b": Placement("replicated", None, 2),
    }
    *_, placements = repository_config(args)
    assert placements == {"": Placement("auto"), "c": Placement("sharded")}
    # No flag: pxrt.load's own default (auto, or $PXRT_PLACEMENT).
    [(_, _, _, place)] = model_specs(_serve_args(str(tmp_path / "m")), str(tmp_path))
    assert place == Placement() and place.load_options() == {}


def test_serve_toml_sets_a_decoders_load_options(tmp_path):
    """A decoder's own pxrt.load options (slots, cells, prefix cache, steps...) come
    from its [models.NAME] section, checked by name; not from [defaults]."""
    from serving.config import model_specs

    conf = tmp_path / "serve.toml"
    conf.write_text(
        "[models.lm]\npath = 'x'\nslots = 8\nmax_length = 128\nprefill_lengths = [16, 64]\n"
        "step_slots = []\nprefix_cache_tokens = 0\nsampling_controls = false\n"
        "placement = 'sharded'\n"
    )
    [(name, _, _, place)] = model_specs(_serve_args("--config", str(conf)), str(tmp_path))
    assert name == "lm" and place.load_options() == {
        "placement": "sharded", "slots": 8, "max_length": 128, "prefill_lengths": (16, 64),
        "step_slots": (), "prefix_cache_tokens": 0, "sampling_controls": False,
    }  # fmt: skip
    for toml, words in [
        ("[models.lm]\npath = 'x'\nstep_slots = [0]\n", "[models.lm] step_slots: [0] is not "
         "a list of integers >= 1"),
        ("[models.lm]\npath = 'x'\nslots = 'many'\n", "[models.lm] slots: 'many' is not an "
         "integer >= 1"),
        ("[models.lm]\npath = 'x'\nsampling_controls = 1\n", "[models.lm] sampling_controls: "
         "1 is not true or false"),
        ("[defaults]\nslots = 8\n", "[defaults] slots: a decoder's load option goes in its "
         "[models.NAME] section"),
    ]:  # fmt: skip
        conf.write_text(toml)
        with pytest.raises(SystemExit, match=re.escape(words)):
            model_specs(_serve_args("--config", str(conf)), str(tmp_path))


def test_serve_with_instances_answers_like_plain_jax(artifacts):
    import httpx
    from servers import ServeProcess

    server = ServeProcess([str(artifacts["mlp"]), "--placement", "replicated"])
    try:
        rng = np.random.default_rng(5)
        for rows in (1, 7):
            x = rng.standard_normal((rows, 32)).astype(np.float32)
            body = {"inputs": [{"name": "x", "shape": [rows, 32], "datatype": "FP32",
                                "data": x.ravel().tolist()}]}  # fmt: skip
            reply = httpx.post(f"{server.url}/v2/models/mlp/infer", json=body, timeout=30)
            assert reply.status_code == 200, reply.text
            y = np.array(reply.json()["outputs"][0]["data"], np.float32).reshape(rows, 32)
            np.testing.assert_allclose(y, reference("mlp", {"x": x})["y"], rtol=1e-5, atol=1e-5)
        assert f"{N} instances" in server.output() or N == 1
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert ("pxrt_instance_batches_total{" in metrics) == (N > 1)
    finally:
        server.stop()


def test_blocking_server_loads_with_a_placement(artifacts):
    from serving import BlockingServer

    with BlockingServer() as server:
        model = server.load_model(
            "mlp", str(artifacts["mlp"]), load_options={"placement": "replicated"}
        )
        assert len(model.instances) == N
        x = np.random.default_rng(6).standard_normal((9, 32)).astype(np.float32)
        assert_matches(server.infer("mlp", {"x": x}), reference("mlp", {"x": x}))
