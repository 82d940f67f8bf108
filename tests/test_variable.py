"""Named dimensions: export, the grid of cells, padded inputs and cut outputs, lanes in
the batch queue, the cell choice, and the front ends. Outputs are compared with plain
jax.jit on the unpadded inputs."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import types

import numpy as np
import pytest
from models import (
    ENCODER,
    ENCODER_SIZES,
    assert_matches,
    encoder_reference,
    ragged_reference,
    ragged_request,
)

import pxrt
from pxrt import _batch_py, _handlers_py, artifact, demo
from serving import Server
from serving.engine.policy import BATCH_HOST_S, choose_cell, efficient_cap

# How batches split over the devices, and the Cython modules end to end: `make test`
# also runs this module on one device with the pure-Python twins (PXRT_NO_EXTENSIONS=1).
pytestmark = [pytest.mark.devices, pytest.mark.twins]

DATA = os.path.join(os.path.dirname(__file__), "data")
SEQ = ENCODER["dim_buckets"]["seq"]


def encoder_request(rows, length, seed):
    r = demo.encoder_request(rows, length, seed=seed, vocab=ENCODER_SIZES["vocab"])
    r["mask"][:, length - 1 :] = length == 1 or seed % 2 == 0  # some padding of their own
    return r


# --------------------------------------------------------------------------- export


def test_manifest_records_named_dims_and_pads(var_artifacts):
    with open(var_artifacts["ragged"] / "manifest.json") as f:
        m = json.load(f)
    assert m["format_version"] == artifact.FORMAT_VERSION == 3
    assert m["inputs"] == [
        {"name": "x", "dtype": "float32", "shape": [3, "seq"], "pad": -1024.0},
        {"name": "w", "dtype": "int32", "shape": ["seq"], "pad": 0},
    ]
    assert m["outputs"] == [
        {"name": "c", "dtype": "int32", "shape": ["seq"]},
        {"name": "m", "dtype": "float32", "shape": [3]},
        {"name": "y", "dtype": "float32", "shape": [3, "seq"]},
    ]
    assert m["dim_buckets"] == {"seq": [4, 8]}
    art = pxrt.read_artifact(var_artifacts["ragged"])
    assert art.inputs["x"].dims == ("seq",) and art.inputs["x"].pad == -1024.0


def _export(tmp_path, fn=lambda p, x: {"y": x * 2}, **kw):
    kw.setdefault("inputs", {"x": pxrt.TensorSpec(("seq",), "float32")})
    kw.setdefault("dim_buckets", {"seq": (4,)})
    return pxrt.export(fn, {}, tmp_path / "m", batch_buckets=(1,), overwrite=True, **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dim_buckets=None), "'seq' varies per request but has no buckets"),
        (dict(dim_buckets={"seq": (4,), "len": (2,)}), "names \\['len'\\], which no input has"),
        (dict(dim_buckets={"seq": (0, 4)}), "must be non-empty, positive"),
        (dict(dim_buckets={"seq": (2.5,)}), "must be positive ints"),
        (dict(fn=lambda p, x: {"y": x[:, 1:]}), "'y'.*not seq - 1"),
        (dict(fn=lambda p, x: {"y": x.sum()}), "batch dimension"),
    ],
)
def test_export_refuses_bad_named_dims(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _export(tmp_path, **kw)


@pytest.mark.parametrize(
    "args, match",
    [
        (((("b",), "float32")), "'b' is not usable"),
        (((("2x",), "float32")), "'2x' is not usable"),
        ((((4,), "float32", 1e39)), "not exactly representable as float32"),
        ((((4,), "float16", 0.1)), "not exactly representable as float16"),
        ((((4,), "int8", 300)), "not exactly representable as int8"),
        ((((4,), "bool", 2)), "not exactly representable as bool"),
        ((((4,), "int32", 1.5)), "not exactly representable as int32"),
    ],
)
def test_tensor_spec_checks_names_and_pads(args, match):
    with pytest.raises(ValueError, match=match):
        pxrt.TensorSpec(*args)


def test_edited_named_dims_or_pads_are_refused(tmp_path):
    path = _export(tmp_path)
    manifest = os.path.join(path, "manifest.json")
    with open(manifest) as f:
        original = json.load(f)
    for edit, match in [
        (lambda m: m["inputs"][0].update(pad=1.0), "were edited"),
        (
            lambda m: (
                [t.update(shape=[4]) for t in m["inputs"] + m["outputs"]]
                and m.update(dim_buckets={}, bounds={})
            ),
            "manifest does not match the program",
        ),
        (lambda m: m.update(bounds={"seq": 0}), "'bounds' must map the dimensions"),
        (lambda m: m.update(bounds={"len": 4}), "'bounds' must map the dimensions"),
        (lambda m: m.update(dim_buckets={}), r"inputs\[0\].shape must be .* 'dim_buckets'"),
        (
            lambda m: m.update(dim_buckets={"seq": [4], "len": [2]}),
            "'dim_buckets' must give lengths for exactly",
        ),
        (lambda m: m.update(dim_buckets={"seq": [0]}), "'dim_buckets' must map"),
        (lambda m: m["inputs"][0].update(pad="x"), r"inputs\[0\].pad"),
    ]:
        m = json.loads(json.dumps(original))
        edit(m)
        with open(manifest, "w") as f:
            json.dump(m, f)
        with pytest.raises(pxrt.ArtifactError, match=match):
            pxrt.read_artifact(path)


def test_a_format_2_artifact_still_loads_and_runs(tmp_path):
    # Written by pxrt before named dimensions (format 2): no pads, no dim_buckets.
    path = shutil.copytree(os.path.join(DATA, "format2-mlp"), tmp_path / "old")
    model = pxrt.load(path)
    assert model.artifact.manifest["format_version"] == 2 and model.dim_buckets == {}
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    k = np.array([1, -2, 3], np.int32)
    p = dict(np.load(os.path.join(path, "params.npz")))
    want = np.tanh(x @ p["p0001"] + p["p0000"]) * k[:, None]  # params in key order: b, w
    np.testing.assert_allclose(model.run({"x": x, "k": k})["y"], want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- load


def test_load_compiles_the_grid(var_models):
    model = var_models["encoder"]
    n_dev = len(model.devices)
    sizes = sorted({-(-b // n_dev) * n_dev for b in ENCODER["buckets"]})
    assert model.dim_buckets == {"seq": SEQ}
    assert sorted((s, c["seq"]) for s, c in model.cells) == sorted(
        (s, L) for s in sizes for L in SEQ
    )
    info = model.describe()
    assert {(b["bucket"], b["lengths"]["seq"]) for b in info["buckets"]} == {
        (s, L) for s in sizes for L in SEQ
    }
    assert all(b["compile_s"] > 0 and b["exec_ms"] > 0 for b in info["buckets"])
    assert model.bucket(sizes[0], seq=SEQ[1]).lengths == (SEQ[1],)


def test_load_takes_a_subset_of_the_grid(var_artifacts):
    n_dev = len(pxrt.load(var_artifacts["ragged"], buckets=(1,), dim_buckets={"seq": (4,)}).devices)
    model = pxrt.load(var_artifacts["ragged"], buckets=[(1, 4), (4, 8)])
    assert sorted((s, c["seq"]) for s, c in model.cells) == sorted(
        {(n_dev, 4), (-(-4 // n_dev) * n_dev, 8)}
    )
    one = pxrt.load(var_artifacts["ragged"], dim_buckets={"seq": (6,)})
    assert one.dim_buckets == {"seq": (6,)}
    rng = np.random.default_rng(0)
    request = ragged_request(2, 5, rng)
    assert_matches(one.run(request), ragged_reference(request))
    with pytest.raises(ValueError, match="dim_buckets names \\['len'\\]"):
        pxrt.load(var_artifacts["ragged"], dim_buckets={"len": (4,)})
    with pytest.raises(ValueError, match="a cell is \\(batch, seq\\)"):
        pxrt.load(var_artifacts["ragged"], buckets=[(1, 4, 4)])


# --------------------------------------------------------------------------- run


@pytest.mark.parametrize(
    "length", sorted({1, 2} | {L for b in SEQ for L in (b - 1, b, b + 1)} - {SEQ[-1] + 1})
)
def test_encoder_matches_jax_on_the_unpadded_input(var_models, length):
    model = var_models["encoder"]
    request = encoder_request(3, length, seed=length)
    got = model.run(request)
    assert got["hidden"].shape == (3, length, ENCODER_SIZES["dim"])
    assert_matches(got, encoder_reference(request), f"L={length}")
    assert model.compiles_after_load == 0


@pytest.mark.parametrize("length", [1, 3, 4, 5, 8])
def test_named_dim_inside_the_shape_with_a_pad_value(var_models, length):
    rng = np.random.default_rng(length)
    request = ragged_request(2, length, rng)
    request["x"][0] -= 500.0  # all negative: padded with 0 instead of -1024, the max is 0
    got = var_models["ragged"].run(request, copy=length % 2 == 0)
    assert got["y"].shape == (2, 3, length) and got["c"].shape == (2, length)
    assert_matches(got, ragged_reference(request))


def test_run_batch_mixes_lengths_and_splits(var_models):
    model = var_models["encoder"]
    rng = np.random.default_rng(1)
    shapes = [(1, 3), (2, 20), (model.max_batch + 3, 9), (1, 32), (3, 8), (2, 17)]
    requests = [encoder_request(n, L, seed=i) for i, (n, L) in enumerate(shapes)]
    bad = encoder_request(1, 5, seed=0) | {"mask": np.ones((1, 6), bool)}
    results = model.run_batch(requests[:2] + [bad] + requests[2:], return_exceptions=True)
    assert isinstance(results[2], ValueError) and "disagree on dimension 'seq'" in str(results[2])
    for request, got in zip(requests, results[:2] + results[3:]):
        assert_matches(got, encoder_reference(request))
    del rng


@pytest.mark.parametrize(
    "request_, match",
    [
        (
            {"tokens": np.zeros((1, 5), np.int32), "mask": np.ones((1, 6), bool)},
            "inputs disagree on dimension 'seq': 'tokens' has 5, 'mask' has 6",
        ),
        (
            {"tokens": np.zeros((2, 33), np.int32), "mask": np.ones((2, 33), bool)},
            "input 'tokens': dimension 'seq' \\(axis 1\\) is 33; the model takes lengths 1 to "
            "32 \\(longer inputs are never truncated\\)",
        ),
        (
            {"tokens": np.zeros((1, 0), np.int32), "mask": np.ones((1, 0), bool)},
            "input 'tokens': dimension 'seq' \\(axis 1\\) is 0; the model takes lengths 1 to 32",
        ),
        (
            {"tokens": np.zeros((1,), np.int32), "mask": np.ones((1,), bool)},
            "input 'tokens': expected shape int32\\[n, seq\\]",
        ),
        (
            {"tokens": np.zeros((1, 4, 1), np.int32), "mask": np.ones((1, 4), bool)},
            "input 'tokens': expected shape int32\\[n, seq\\]",
        ),
    ],
)
def test_bad_lengths_name_the_input_and_the_dimension(var_models, request_, match):
    model = var_models["encoder"]
    model.run(encoder_request(1, 4, seed=0))  # the inline cache holds a good signature
    with pytest.raises(ValueError, match=match):
        model.run(request_)


# --------------------------------------------------------------------------- handlers


def _handler_pairs(model):
    from pxrt import _ext

    ih, rh = model.engine.input_handler, model.engine.result_handler
    pairs = [(ih, rh)]
    if _ext.using_extensions():  # the other kind too: the pure-Python twin
        args = (ih.model, ih.names, ih.dtypes, ih.shapes, 256, ih.dim_lengths)
        from pxrt.dispatch import lane_key, lane_table

        _, lanes = lane_table(sorted({b.lengths for b in model.engine.buckets}, key=lane_key))
        pads = [model.inputs[n].pad for n in ih.names]
        pairs.append(
            (
                _handlers_py.InputHandler(*args, lanes, pads),
                _handlers_py.ResultHandler(rh.names, rh.dtypes, rh.shapes, ih.dim_names),
            )
        )
    return pairs


def test_padded_assemble_and_cut_split_agree_between_cython_and_python(var_models):
    model = var_models["ragged"]
    rng = np.random.default_rng(3)
    requests = [ragged_request(n, L, rng) for n, L in [(1, 3), (2, 8), (1, 1), (1, 5)]]
    # A source whose rows are strided (every other row of a bigger array).
    wide = ragged_request(4, 6, rng)
    requests.append({k: v[::2] for k, v in wide.items()})
    outs = []
    for ih, rh in _handler_pairs(model):
        prepared = [ih.prepare(r) for r in requests]
        assert [ih.lane_of(a) for a, _ in prepared] == [0, 1, 0, 1, 1]
        assert [ih.lengths_of(a) for a, _ in prepared] == [(3,), (8,), (1,), (5,), (6,)]
        bufs = [np.full((8, 3, 8), 7.0, np.float32), np.full((8, 8), 7, np.int32)]
        pieces = [a for a, _ in prepared]
        starts = [0, 1, 0, 0, 0]
        counts = [1, 1, 1, 1, 2]
        assert ih.assemble(pieces, starts, counts, bufs) == 6
        # Every valid element in the corner of its row, the input's pad everywhere else.
        want_x = np.full((8, 3, 8), -1024.0, np.float32)
        want_w = np.zeros((8, 8), np.int32)
        row = 0
        for (arrays, _), s, c in zip(prepared, starts, counts):
            L = arrays[0].shape[2]
            want_x[row : row + c, :, :L] = arrays[0][s : s + c]
            want_w[row : row + c, :L] = arrays[1][s : s + c]
            row += c
        np.testing.assert_array_equal(bufs[0], want_x)
        np.testing.assert_array_equal(bufs[1], want_w)
        # Split the (pretend) outputs of two shards back, cut per piece.
        y = np.arange(8 * 3 * 8, dtype=np.float32).reshape(8, 3, 8)
        m = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
        c = np.arange(64, dtype=np.int32).reshape(8, 8)
        shards = [[c[:4], c[4:]], [m[:4], m[4:]], [y[:4], y[4:]]]
        lengths = [ih.lengths_of(a) for a in pieces]
        offsets = [0, 1, 2, 5, 3]  # the last piece straddles the two shards
        split = rh.split(shards, 4, offsets, counts, False, lengths)
        for piece, (off, cnt, (L,)) in zip(split, zip(offsets, counts, lengths)):
            np.testing.assert_array_equal(piece["y"], y[off : off + cnt, :, :L])
            np.testing.assert_array_equal(piece["c"], c[off : off + cnt, :L])
            np.testing.assert_array_equal(piece["m"], m[off : off + cnt])
        assert np.shares_memory(split[0]["y"], y)  # a view where the piece is in one shard
        assert not np.shares_memory(split[4]["y"], y) and not split[4]["y"].flags.writeable
        outs.append(split)
    for a, b in zip(outs, outs[1:]):
        for pa, pb in zip(a, b):
            for k in pa:
                np.testing.assert_array_equal(pa[k], pb[k])


def test_lanes_table_maps_lengths_to_the_cheapest_cell():
    from pxrt.dispatch import lane_table

    # Two named dims, part of the grid: (4, 2), (4, 8), (16, 2); (16, 8) missing.
    per_dim, table = lane_table([(4, 2), (16, 2), (4, 8)])
    assert per_dim == [(4, 16), (2, 8)]
    assert table == [0, 2, 1, -1]  # (4,2)->0, (4,8)->2, (16,2)->1, (16,8)->none
    handler = _handlers_py.InputHandler(
        "m", ["a", "b"], ["int32", "int32"], [("s",), ("t",)], 8, per_dim, table
    )
    arrays, _ = handler.prepare({"a": np.zeros((1, 3), np.int32), "b": np.zeros((1, 5), np.int32)})
    assert handler.lane_of(arrays) == 2
    arrays, _ = handler.prepare({"a": np.zeros((1, 9), np.int32), "b": np.zeros((1, 5), np.int32)})
    with pytest.raises(ValueError, match="no compiled cell holds lengths \\{'s': 9, 't': 5\\}"):
        handler.lane_of(arrays)


# --------------------------------------------------------------------------- queue lanes


@pytest.mark.parametrize("impl", ["ext", "py"])
def test_queue_lanes_take_and_fold(impl):
    from pxrt import _ext

    if impl == "ext" and not _ext.using_extensions():
        pytest.skip("the Cython build is not in use")
    BQ = _ext.BatchQueue if impl == "ext" else _batch_py.BatchQueue
    q = BQ(lanes=3)
    a = (np.zeros((1, 1)),)
    reqs = [q.push(a * 1, rows, lane=lane) for rows, lane in [(2, 0), (3, 2), (1, 1), (4, 0)]]
    assert [q.lane_rows(k) for k in range(3)] == [6, 1, 3] and q.queued_rows == 10
    rows, n, ages, oldest = q.lane_stats(0, 4, reqs[3].t_enqueue + 1.0)
    assert (rows, n) == (4, 2) and oldest == reqs[0].t_enqueue and ages > 1.0
    # Lane 2's request, then whole requests of lanes 1 and 0 while they fit 6 rows.
    batch = q.take(6, 0.0, 2, (1, 0))
    assert batch.lane == 2 and batch.rows == 6 and batch.counts == [3, 1, 2]
    assert [r is x for r, x in zip(batch.requests, [reqs[1], reqs[2], reqs[0]])] == [True] * 3
    assert [q.lane_rows(k) for k in range(3)] == [4, 0, 0]
    q.cancel(reqs[3])
    assert q.queued_rows == 0 and q.lane_rows(0) == 0 and q.take(8, 0.0, 0) is None
    with pytest.raises(IndexError):
        q.take(1, 0.0, 3)


# --------------------------------------------------------------------------- serving


@pytest.mark.parametrize(
    "top_ms, want",
    [
        # Padding is cheap in the long cell (overhead-bound): the short ones ride along.
        (lambda rows: 10.0 + 0.05 * rows, "top+fold"),
        # Padding costs more than their own batch saves: the long one goes alone.
        (lambda rows: 10.0 * rows, "top"),
    ],
)
def test_cost_policy_folds_short_requests_when_it_pays(top_ms, want):
    # Three lanes: a long request has waited longest in the top one; two short ones
    # wait in lane 0. Execution times are given (ms by rows), so the choice is exact.
    stats = [(2, 2, 0.0, 1.05), (0, 0, 0.0, math.inf), (1, 1, 0.05, 1.0)]
    caps = [8, 8, 8]
    exec_s = lambda lane, rows: (top_ms(rows) if lane == 2 else 1.0) * 1e-3  # noqa: E731
    fold_lanes = [(), (0,), (1, 0)]
    # The oldest request's lane goes, and the short ones ride along when
    # d * (n + n_i + m) < T_i * (n_i + m): here d * 3 < 1 ms * 2.
    got = choose_cell("cost", stats, caps, exec_s, fold_lanes, False)
    assert got == ((2, (0,), 8) if want == "top+fold" else (2, (), 8))
    assert choose_cell("oldest", stats, caps, exec_s, fold_lanes, False) == (2, (), 8)
    # With a batch in flight only a full batch goes: none here, then lane 0's.
    assert choose_cell("cost", stats, caps, exec_s, fold_lanes, True) is None
    assert choose_cell("cost", stats, [2, 8, 8], exec_s, fold_lanes, True) == (0, (), 2)
    # ... or a lane whose oldest request was queued before its bound (``stale``): the
    # long one (queued at 1.0) once its bound passes, not the short ones' (1.05) yet.
    for policy in ("cost", "oldest"):
        assert choose_cell(policy, stats, caps, exec_s, fold_lanes, True, [1.0] * 3) is None
        got = choose_cell(policy, stats, caps, exec_s, fold_lanes, True, [1.0, 1.0, 1.01])
        assert got is not None and got[0] == 2, got
    got = choose_cell("cost", stats, caps, exec_s, fold_lanes, True, [1.06, 1.0, 1.0])
    assert got == (0, (), 8), got  # (lane 0 alone: it is stale, the long one is not)
    assert (
        choose_cell("oldest", [(0, 0, 0.0, math.inf)] * 3, caps, exec_s, fold_lanes, False) is None
    )


def test_cost_policy_caps_a_lane_at_its_most_efficient_bucket(var_models):
    for lane in var_models["encoder"].engine.lanes:
        for limit in {lane.max_rows, max(1, lane.max_rows // 2)}:
            fallback = lane.bucket_for(limit).size
            cap = efficient_cap(lane.buckets, limit, fallback)
            fits = [x for x in lane.buckets if x.size <= limit]
            if not fits:  # every bucket is bigger (4 devices: the smallest is 4 rows)
                assert cap == fallback
                continue
            best = min((x.exec_s + BATCH_HOST_S) / x.size for x in fits)
            chosen = lane.bucket_for(cap)
            assert chosen.size == cap and (chosen.exec_s + BATCH_HOST_S) / cap == best
    one = types.SimpleNamespace
    buckets = [one(size=4, exec_s=1.0), one(size=8, exec_s=2.0), one(size=16, exec_s=8.0)]
    assert efficient_cap(buckets, 16, 16) == 8  # a tie: the bigger one
    assert efficient_cap(buckets, 2, 4) == 4  # none that small: the fallback
    # A few percent per row is within the batch's host work: the bigger bucket.
    us = 1e-6
    near = [one(size=8, exec_s=8 * 35 * us), one(size=32, exec_s=32 * 37 * us)]
    assert efficient_cap(near, 32, 32) == 32
    # Attention's cost per row, growing with the batch, still caps it.
    attention = [one(size=8, exec_s=19e-3), one(size=32, exec_s=190e-3)]
    assert efficient_cap(attention, 32, 32) == 8


@pytest.mark.parametrize("policy", ["cost", "oldest"])
def test_server_serves_mixed_lengths_and_bad_ones_fail_alone(var_models, run, policy):
    model = var_models["encoder"]
    rng = np.random.default_rng(7)
    # Lengths on both sides of each compiled length (the plain-JAX reference compiles
    # once per shape, so not every length).
    lengths = sorted({1, SEQ[-1]} | {s + d for s in SEQ for d in (-1, 1)} - {SEQ[-1] + 1})
    shapes = [(int(rng.integers(1, 4)), int(rng.choice(lengths))) for _ in range(60)]
    requests = [encoder_request(n, L, seed=i) for i, (n, L) in enumerate(shapes)]
    bad = [
        {"tokens": np.zeros((1, 5), np.int32), "mask": np.ones((1, 6), bool)},
        {"tokens": np.zeros((1, SEQ[-1] + 1), np.int32), "mask": np.ones((1, SEQ[-1] + 1), bool)},
        {"tokens": np.zeros((1, 0), np.int32), "mask": np.ones((1, 0), bool)},
    ]

    async def main():
        async with Server() as server:
            server.add_model("enc", model, cell_policy=policy)
            mixed = requests[:20] + bad + requests[20:]
            outs = await asyncio.gather(
                *(server.infer("enc", r) for r in mixed), return_exceptions=True
            )
            snap = server.metrics_snapshot()["enc"]
        return outs[:20] + outs[23:], outs[20:23], snap

    good, errors, snap = run(main)
    for request, got in zip(requests, good):
        assert_matches(got, encoder_reference(request))
    assert all(isinstance(e, ValueError) for e in errors)
    assert "'seq'" in str(errors[0]) and "'seq'" in str(errors[1]) and "'seq'" in str(errors[2])
    assert snap["requests"]["success"] == len(requests) and snap["requests"]["invalid"] == 3
    assert model.compiles_after_load == 0


def test_serving_rejects_an_unknown_cell_policy(var_models, run):
    async def main():
        async with Server() as server:
            with pytest.raises(ValueError, match="cell_policy: .fifo. is not one of cost, oldest"):
                server.add_model("enc", var_models["encoder"], cell_policy="fifo")

    run(main)


def test_two_named_dims_in_any_manifest_order(tmp_path):
    # Two named dimensions; the manifest lists their buckets in the other order (as a
    # JSON tool that sorts keys would): lengths must still be read per dimension.
    def fn(p, a, b):
        return {"ab": a.sum(axis=2)[:, :, None] + b[:, None, :], "n": a.sum(axis=(1, 2))}

    path = pxrt.export(
        fn,
        {},
        tmp_path / "two",
        inputs={"a": pxrt.TensorSpec(("t", "s"), "int32"), "b": pxrt.TensorSpec(("s",), "int32")},
        batch_buckets=(1,),
        dim_buckets={"t": (2, 8), "s": (4, 100)},
    )
    manifest = os.path.join(path, "manifest.json")
    with open(manifest) as f:
        m = json.load(f)
    m["dim_buckets"] = {"s": m["dim_buckets"]["s"], "t": m["dim_buckets"]["t"]}
    with open(manifest, "w") as f:
        json.dump(m, f)
    model = pxrt.load(path)
    assert model.dim_names == ("t", "s")
    rng = np.random.default_rng(0)
    for t, s in [(1, 3), (7, 4), (2, 90), (8, 100)]:
        request = {
            "a": rng.integers(-9, 9, (2, t, s)).astype(np.int32),
            "b": rng.integers(-9, 9, (2, s)).astype(np.int32),
        }
        got = model.run(request)
        want = fn({}, **request)
        assert got["ab"].shape == (2, t, s)
        np.testing.assert_array_equal(got["ab"], np.asarray(want["ab"]))
        np.testing.assert_array_equal(got["n"], np.asarray(want["n"]))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m["inputs"][0].update(shape=[[8]]), r"inputs\[0\].shape"),
        (lambda m: m["inputs"][0].update(dtype=["int32"]), r"inputs\[0\].dtype"),
        (lambda m: m["inputs"][0].update(pad=10**400), r"inputs\[0\].pad"),
    ],
)
def test_malformed_format_3_fields_are_artifact_errors(tmp_path, edit, match):
    path = _export(tmp_path)
    manifest = os.path.join(path, "manifest.json")
    with open(manifest) as f:
        m = json.load(f)
    edit(m)
    with open(manifest, "w") as f:
        json.dump(m, f)
    with pytest.raises(pxrt.ArtifactError, match=match):
        pxrt.read_artifact(path)


def test_a_deadline_is_kept_in_a_lane_while_another_batch_runs(var_models, run):
    from models import inject

    model = var_models["ragged"]
    rng = np.random.default_rng(2)

    async def main():
        # (seconds apart: on a loaded 2-core machine a turn of the loop can take
        # hundreds of milliseconds)
        with inject(model, delay_s=2.0) as gate:  # every batch takes 2 s
            async with Server() as server:
                server.add_model("r", model, max_inflight=2)
                long = asyncio.ensure_future(server.infer("r", ragged_request(1, 8, rng)))
                await gate.wait_started()  # the long one runs; one pipeline slot is free
                # Not a full batch, due a second after the running one ends: it goes
                # then, and is not dropped as due before it could run.
                short = await server.infer("r", ragged_request(1, 2, rng), timeout_s=3.0)
                await long
                return short

    assert run(main)["c"].shape == (1, 2)
