"""The Cython handlers and keys against their pure-Python twins: identical results."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pxrt
from pxrt import _handlers_py, _keys_py

# How batches split over the devices, and the Cython modules end to end: `make test`
# also runs this module on one device with the pure-Python twins (PXRT_NO_EXTENSIONS=1).
pytestmark = [pytest.mark.devices, pytest.mark.twins]


try:
    from pxrt import _handlers as _handlers_c
    from pxrt import _keys as _keys_c
except ImportError:  # pragma: no cover - only when the extension is not built
    _handlers_c = _keys_c = None

needs_ext = pytest.mark.skipif(_handlers_c is None, reason="Cython extensions not built")

DTYPES = [np.dtype(d) for d in ("float32", "float16", "int32", "int64", "uint8", "bool")] + [
    np.dtype(ml_dtypes.bfloat16)
]
IMPLS = [
    pytest.param(_handlers_py, id="py"),
    pytest.param(_handlers_c, id="cython", marks=needs_ext),
]


def test_extension_selection_follows_the_environment():
    import os

    if os.environ.get("PXRT_NO_EXTENSIONS") == "1":
        assert not pxrt.using_extensions()
    else:
        # CI builds the extensions: a silent fallback to Python would hide a broken build.
        assert pxrt.using_extensions()


# --------------------------------------------------------------------------- keys


@needs_ext
def test_keys_are_identical_in_both_implementations():
    reqs = [
        {"a": np.zeros((2, 3), np.float32), "b": np.zeros((2,), np.int64)},
        {"b": np.zeros((2,), np.int64), "a": np.zeros((2, 3), np.float32)},
        {"a": np.zeros((5, 3, 1), ml_dtypes.bfloat16)},
        {"a": np.zeros((5, 3), ">f4")},
        {"a": np.zeros((), np.float32)},
    ]
    for r in reqs:
        assert _keys_c.signature(r) == _keys_py.signature(r)
    keys = [_keys_c.signature(r) for r in reqs]
    assert len(set(keys)) == len(keys), "distinct signatures must have distinct keys"
    # The leading (batch) dimension is not part of the key.
    assert _keys_c.signature({"a": np.zeros((7, 3), np.float32)}) == _keys_c.signature(
        {"a": np.zeros((1, 3), np.float32)}
    )


class _Sub(np.ndarray):
    pass


@pytest.mark.parametrize(
    "keys", [pytest.param(_keys_py, id="py"), pytest.param(_keys_c, id="cython", marks=needs_ext)]
)
def test_non_plain_requests_have_no_key(keys):
    assert keys.signature([np.zeros(2)]) is None
    assert keys.signature({"a": [1, 2]}) is None
    assert keys.signature({"a": np.ma.zeros(2)}) is None
    assert keys.signature({"a": np.zeros(2).view(_Sub)}) is None


@pytest.mark.parametrize(
    "keys", [pytest.param(_keys_py, id="py"), pytest.param(_keys_c, id="cython", marks=needs_ext)]
)
def test_route_cache_is_bounded_and_clearable(keys):
    cache = keys.RouteCache(3)
    for i in range(10):
        cache.put(("k", i), i)
        assert len(cache) <= 3
    assert cache.get(("k", 9)) == 9 and cache.get(("k", 0)) is None
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError):
        keys.RouteCache(0)


@needs_ext
def test_signature_does_not_leak_references():
    arr = np.zeros((2, 3), np.float32)
    req = {"a": arr, "b": arr}
    before = (sys.getrefcount(arr), sys.getrefcount("a"))
    for _ in range(1000):
        _keys_c.signature(req)
    assert (sys.getrefcount(arr), sys.getrefcount("a")) == before


# --------------------------------------------------------------------------- handlers

specs_strategy = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=2).map(tuple)),
    min_size=1,
    max_size=3,
)


def _buffer(dtype, shape, rows):
    return np.full((rows,) + shape, 7, dtype)  # stale data that padding must clear


def _array(rng, dtype, shape, rows, layout):
    base = rng.integers(-50, 50, (rows * 2,) + shape).astype(dtype)
    if layout == "strided":
        return base[::2]
    if layout == "reversed":
        return base[:rows][::-1]
    return np.ascontiguousarray(base[:rows])


@needs_ext
@settings(max_examples=60, deadline=None)
@given(
    specs=specs_strategy,
    rows=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    layout=st.sampled_from(["contiguous", "strided", "reversed"]),
    shards=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
    copy=st.booleans(),
)
def test_assemble_and_split_match_the_python_twin(specs, rows, layout, shards, seed, copy):
    rng = np.random.default_rng(seed)
    names = [f"in{i}" for i in range(len(specs))]
    dtypes = [d for d, _ in specs]
    shapes = [s for _, s in specs]
    total = sum(rows)
    bucket = -(-(total + int(rng.integers(0, 5))) // shards) * shards
    requests = [
        {n: _array(rng, d, s, r, layout) for n, d, s in zip(names, dtypes, shapes)} for r in rows
    ]

    results = {}
    for impl in (_handlers_py, _handlers_c):
        handler = impl.InputHandler("m", names, dtypes, shapes)
        prepared = [handler.prepare(r) for r in requests]
        assert [n for _, n in prepared] == rows
        buffers = [_buffer(d, s, bucket) for d, s in zip(dtypes, shapes)]
        starts = [0] * len(rows)
        written = handler.assemble([a for a, _ in prepared], starts, list(rows), buffers)
        assert written == total
        # Outputs: pretend the program is the identity, split into equal row shards.
        per = bucket // shards
        outputs = [[buf[i * per : (i + 1) * per].copy() for i in range(shards)] for buf in buffers]
        splitter = impl.ResultHandler(names, dtypes, shapes)
        offsets = list(np.cumsum([0] + rows[:-1]))
        results[impl.__name__] = (buffers, splitter.split(outputs, per, offsets, list(rows), copy))

    (buf_py, out_py), (buf_c, out_c) = results.values()
    for a, b in zip(buf_py, buf_c):
        np.testing.assert_array_equal(a, b)
        assert not np.any(a[total:]), "padding rows must be zero"
    for req, got_py, got_c in zip(requests, out_py, out_c):
        assert list(got_py) == list(got_c) == names
        for n in names:
            np.testing.assert_array_equal(got_py[n], req[n])
            np.testing.assert_array_equal(got_c[n], req[n])
            assert got_c[n].dtype == got_py[n].dtype == req[n].dtype
            assert got_c[n].flags.writeable == got_py[n].flags.writeable


@pytest.mark.parametrize("impl", IMPLS)
def test_assemble_pieces_of_a_request(impl):
    handler = impl.InputHandler("m", ["x"], [np.float32], [(2,)])
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    (arrays, n) = handler.prepare({"x": x})
    buf = np.full((8, 2), -1, np.float32)
    assert handler.assemble([arrays, arrays], [7, 0], [3, 2], [buf]) == 5
    np.testing.assert_array_equal(buf[:5], np.concatenate([x[7:10], x[0:2]]))
    assert not buf[5:].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_assemble_refuses_what_does_not_fit(impl):
    handler = impl.InputHandler("m", ["x"], [np.float32], [(2,)])
    arrays, _ = handler.prepare({"x": np.zeros((4, 2), np.float32)})
    with pytest.raises(ValueError):
        handler.assemble([arrays], [0], [4], [np.zeros((3, 2), np.float32)])
    with pytest.raises(ValueError):
        handler.assemble([arrays], [2], [3], [np.zeros((8, 2), np.float32)])


@pytest.mark.parametrize("impl", IMPLS)
def test_split_views_share_memory_with_the_shards(impl):
    splitter = impl.ResultHandler(["y"], [np.float32], [(3,)])
    shards = [np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * i for i in range(2)]
    for s in shards:
        s.flags.writeable = False
    inside, across = splitter.split([shards], 4, [1, 3], [2, 3])
    assert np.shares_memory(inside["y"], shards[0]) and not inside["y"].flags.writeable
    np.testing.assert_array_equal(inside["y"], shards[0][1:3])
    assert not np.shares_memory(across["y"], shards[0])
    np.testing.assert_array_equal(across["y"], np.concatenate(shards)[3:6])
    copied = splitter.split([shards], 4, [1], [2], True)[0]["y"]
    assert copied.flags.writeable and not np.shares_memory(copied, shards[0])


@needs_ext
def test_split_views_keep_their_shard_alive():
    splitter = _handlers_c.ResultHandler(["y"], [np.float32], [(3,)])
    shard = np.arange(12, dtype=np.float32).reshape(4, 3).copy()  # owns its data
    before = sys.getrefcount(shard)
    view = splitter.split([[shard]], 4, [1], [2])[0]["y"]
    assert sys.getrefcount(shard) == before + 1
    del view
    assert sys.getrefcount(shard) == before


@needs_ext
def test_errors_are_identical_in_both_implementations():
    args = ("m", ["a", "b"], [np.float32, np.int32], [(2,), ()])
    bad = [
        {"a": np.zeros((2, 2), np.float64), "b": np.zeros(2, np.int32)},
        {"a": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.int32)},
        {"a": np.zeros((2, 2), np.float32)},
        {"a": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.int32)},
        "nope",
    ]
    for req in bad:
        errors = []
        for impl in (_handlers_py, _handlers_c):
            with pytest.raises((TypeError, ValueError)) as info:
                impl.InputHandler(*args).prepare(req)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1]


# --------------------------------------------------------------------------- bool bytes


def _bools_from(raw: bytes, shape) -> np.ndarray:
    # What a decoder of binary tensor data does: numpy takes any byte as a bool.
    return np.frombuffer(raw, np.bool_).reshape(shape)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("at", [0, 7, 8, 12, 16 * 3 - 1])  # word-aligned, the tail, last
@pytest.mark.parametrize("byte", [2, 4, 0x80, 0xFF])
def test_bool_bytes_other_than_0_and_1_are_refused(impl, at, byte):
    h = impl.InputHandler("m", ["x", "mask"], [np.float32, np.bool_], [(2,), (16,)])
    x = np.zeros((3, 2), np.float32)
    raw = bytearray(np.random.default_rng(at).integers(0, 2, 48, dtype=np.uint8).tobytes())
    good = _bools_from(bytes(raw), (3, 16))
    arrays, rows = h.prepare({"x": x, "mask": good})  # 0/1 bytes pass (and are cached)
    assert rows == 3 and arrays[1] is good
    raw[at] = byte
    bad = _bools_from(bytes(raw), (3, 16))
    with pytest.raises(ValueError) as info:
        h.prepare({"x": x, "mask": bad})  # the same signature: the cached route checks too
    assert str(info.value) == (
        f"model 'm': input 'mask': a bool must be the byte 0 or 1, got {byte} at index "
        f"{(at // 16, at % 16)}"
    )
    with pytest.raises(ValueError, match=f"got {byte} at index \\(0, {at % 16}\\)"):
        h.prepare({"x": x[:1], "mask": bad[at // 16 :][:1]})  # the row alone
    strided = _bools_from(bytes(raw) * 2, (6, 16))[::2]  # not contiguous: rows 0, 2, 4
    with pytest.raises(ValueError, match=f"got {byte} at index"):
        h.prepare({"x": x, "mask": strided})


@pytest.mark.parametrize("impl", IMPLS)
def test_bool_checks_leave_other_dtypes_alone(impl):
    h = impl.InputHandler("m", ["x"], [np.uint8], [(4,)])
    x = np.full((2, 4), 0xFF, np.uint8)  # any byte is a uint8
    assert h.prepare({"x": x})[1] == 2


# --------------------------------------------------------------------------- named dimensions

# Input shapes over two named dimensions ("s" compiled at 4 and 8, "t" at 3 and 6); every
# input set mentions both, so each handler's dimension order is ("s", "t") or ("t", "s").
NAMED_SHAPES = [("s",), ("s", 2), (2, "s"), ("t", "s"), ("s", "t"), (3,), ("t",)]
GRID = {"s": (4, 8), "t": (3, 6)}


def _named_array(rng, dtype, shape, rows, layout):
    """rows x shape, with the source laid out as drawn: contiguous, every other row of a
    bigger array (strided rows), reversed rows, or a transpose's view (strided inner axes;
    prepare makes those contiguous)."""
    base = rng.integers(-50, 50, (rows * 2,) + shape).astype(dtype)
    if layout == "strided":
        return base[::2]
    if layout == "reversed":
        return base[:rows][::-1]
    if layout == "transposed" and len(shape) >= 1:
        t = rng.integers(-50, 50, shape[::-1] + (rows,)).astype(dtype)
        return t.T
    return np.ascontiguousarray(base[:rows])


@needs_ext
@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.sampled_from(NAMED_SHAPES), min_size=1, max_size=3).filter(
        lambda ss: {d for s in ss for d in s if isinstance(d, str)} == {"s", "t"}
    ),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=3, max_size=3),
    pieces=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 8), st.integers(1, 6), st.integers(0, 3)),
        min_size=1,
        max_size=5,
    ),
    layout=st.sampled_from(["contiguous", "strided", "reversed", "transposed"]),
    seed=st.integers(0, 2**16),
    copy=st.booleans(),
)
def test_padded_assembly_and_cut_split_match_the_python_twin(
    shapes, dtypes, pieces, layout, seed, copy
):
    """Named-dimension assembly (each piece into the corner of its rows, the input's pad
    everywhere else) and the cut split, on sources of every layout, against the twin and
    against numpy."""
    rng = np.random.default_rng(seed)
    names = [f"in{i}" for i in range(len(shapes))]
    dtypes = dtypes[: len(shapes)]
    dim_names = tuple(dict.fromkeys(d for s in shapes for d in s if isinstance(d, str)))
    dim_lengths = [GRID[d] for d in dim_names]
    pads = [int(rng.integers(0, 4)) if dt != np.bool_ else 1 for dt in dtypes]
    # Requests: per piece, its rows and its length along s and t; the piece taken is
    # rows start:start+count of it.
    requests, starts, counts = [], [], []
    for rows, s, t, skip in pieces:
        lengths = {"s": s, "t": t}
        concrete = [tuple(lengths.get(d, d) for d in shape) for shape in shapes]
        requests.append(
            {n: _named_array(rng, dt, c, rows, layout) for n, dt, c in zip(names, dtypes, concrete)}
        )
        start = min(skip, rows - 1)
        starts.append(start)
        counts.append(int(rng.integers(1, rows - start + 1)))
    total = sum(counts)
    bucket = total + int(rng.integers(0, 3))
    full = [tuple(max(GRID[d]) if isinstance(d, str) else d for d in s) for s in shapes]

    results = []
    for impl in (_handlers_py, _handlers_c):
        handler = impl.InputHandler("m", names, dtypes, shapes, 8, dim_lengths, [0, 1, 2, 3], pads)
        prepared = [handler.prepare(r)[0] for r in requests]
        lengths = [handler.lengths_of(a) for a in prepared]
        lanes = [handler.lane_of(a) for a in prepared]
        buffers = [np.full((bucket,) + f, 7, dt) for f, dt in zip(full, dtypes)]
        assert handler.assemble(prepared, starts, counts, buffers) == total
        # Outputs: the identity, one output per input, split at two shards when they fit.
        shards = 2 if bucket % 2 == 0 else 1
        per = bucket // shards
        outputs = [[b[i * per : (i + 1) * per].copy() for i in range(shards)] for b in buffers]
        offsets = list(np.cumsum([0] + counts[:-1]))
        splitter = impl.ResultHandler(names, dtypes, shapes, dim_names)
        split = splitter.split(outputs, per, offsets, counts, copy, lengths)
        results.append((lengths, lanes, buffers, split))

    (len_py, lanes_py, buf_py, out_py), (len_c, lanes_c, buf_c, out_c) = results
    assert len_py == len_c and lanes_py == lanes_c
    for j, (a, b) in enumerate(zip(buf_py, buf_c)):
        want = np.full_like(a, pads[j])
        row = 0
        for req, start, count in zip(requests, starts, counts):
            src = req[names[j]][start : start + count]
            want[(slice(row, row + count), *(slice(0, n) for n in src.shape[1:]))] = src
            row += count
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)
    for req, start, count, got_py, got_c in zip(requests, starts, counts, out_py, out_c):
        for n in names:
            want = req[n][start : start + count]
            np.testing.assert_array_equal(got_py[n], want)
            np.testing.assert_array_equal(got_c[n], want)
            assert got_c[n].dtype == got_py[n].dtype == want.dtype
            assert got_c[n].flags.writeable == got_py[n].flags.writeable
