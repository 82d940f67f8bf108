"""``pxrt.adapters._inplace.in_place``: a step that slices its cache apart, writes into
the slices and stacks them back (keras-hub's ``call_with_cache``) computes the same
values with its cache updated in place, and its repeated key and value heads read
grouped by the dots."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pxrt.adapters._inplace import in_place
from pxrt.recipes import per_slot

LAYERS, LENGTH, HEADS, DIM = 2, 16, 2, 4


def keras_like(params, cache, tokens, positions):
    """keras-hub's pattern: per layer, the layer's slice of the cache, its key and value
    slices each written at ``positions[0]``, stacked back, then the layers stacked; the
    attention reads the written keys."""
    x = params["embed"][tokens][:, None]  # [1, 1, HEADS * DIM]
    layers = []
    for i in range(LAYERS):
        layer = cache[:, i, ...]
        key, value = layer[:, 0, ...], layer[:, 1, ...]
        new = (x @ params["w"][i]).reshape(1, 1, HEADS, DIM)
        key = jax.lax.dynamic_update_slice(key, new, (0, positions[0], 0, 0))
        value = jax.lax.dynamic_update_slice(value, 2 * new, (0, positions[0], 0, 0))
        scores = jnp.einsum("bqhd,bshd->bhs", new, key)
        x = x + jnp.einsum("bhs,bshd->bhd", jax.nn.softmax(scores), value).reshape(x.shape)
        layers.append(jnp.stack([key, value], axis=1))
    return jnp.stack(layers, axis=1), x[:, 0] @ params["embed"].T


def _inputs(slots: int = 3):
    rng = np.random.default_rng(0)
    params = {
        "embed": jnp.asarray(rng.standard_normal((11, HEADS * DIM)), jnp.float32),
        "w": jnp.asarray(rng.standard_normal((LAYERS, HEADS * DIM, HEADS * DIM)), jnp.float32),
    }
    cache = jnp.asarray(rng.standard_normal((slots, LAYERS, 2, LENGTH, HEADS, DIM)), jnp.float32)
    tokens = jnp.asarray([3, 7, 1][:slots], jnp.int32)
    positions = jnp.asarray([0, 9, LENGTH - 1][:slots], jnp.int32)
    return params, cache, tokens, positions


def _primitives(fn, *args) -> list[str]:
    return [e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]


def test_the_keras_pattern_computes_the_same_with_the_cache_updated_in_place():
    params, cache, tokens, positions = _inputs()
    plain, rewritten = per_slot(keras_like), per_slot(in_place(keras_like, 1))
    want = jax.jit(plain)(params, cache, tokens, positions)
    got = jax.jit(rewritten)(params, cache, tokens, positions)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
    # every position but each slot's written one is the cache it was given
    written = np.zeros(cache.shape, bool)
    written[np.arange(3), :, :, np.asarray(positions)] = True
    np.testing.assert_array_equal(np.asarray(got[0])[~written], np.asarray(cache)[~written])
    # the rewritten step stacks nothing: its cache leaves as the input with updates
    one = (params, cache[:1], tokens[:1], positions[:1])
    assert "stack" in _primitives(keras_like, *one)
    names = _primitives(in_place(keras_like, 1), *one)
    assert "stack" not in names and "concatenate" not in names
    assert names.count("dynamic_update_slice") == 2 * LAYERS


def test_a_slice_read_after_its_region_is_overwritten_keeps_its_old_value():
    def step(cache, update):
        old = cache[:, 0]  # read after the write below: must stay the old value
        new = jax.lax.dynamic_update_slice(cache[:, 0], update, (0, 2))
        other = cache[:, 1]  # a region the write does not touch
        return jnp.stack([new, other], axis=1), old * 10 + other

    cache = jnp.arange(2 * 2 * 5, dtype=jnp.float32).reshape(2, 2, 5)
    update = -jnp.ones((2, 2), jnp.float32)
    want = step(cache, update)
    got = jax.jit(in_place(step, 0))(cache, update)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert "stack" not in _primitives(in_place(step, 0), cache, update)


@pytest.mark.parametrize("start", [-3, 4, 100])
def test_an_update_index_out_of_range_is_clamped_as_dynamic_update_slice_clamps_it(start):
    def step(cache, update, at):  # (clamped to the slice's 6 positions, not the cache's 9)
        rows = [jax.lax.dynamic_update_slice(cache[i, :6], update, (at,)) for i in range(2)]
        return jnp.stack(rows), cache

    cache = jnp.zeros((2, 9), jnp.float32)
    update = jnp.asarray([1.0, 2.0, 3.0])
    want = step(cache, update, start)
    got = jax.jit(in_place(step, 0))(cache, update, jnp.int32(start))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_what_is_not_a_part_of_the_argument_runs_as_it_is():
    def step(cache, x):  # no slices rejoined: a concatenate with a new array
        head = jax.lax.dynamic_update_slice(cache[:2], x, (0, 1))
        return jnp.concatenate([head, cache[2:] + 1]), jnp.sum(cache)

    cache = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
    x = jnp.full((2, 2), 7.0)
    for g, w in zip(jax.jit(in_place(step, 0))(cache, x), step(cache, x)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_with_a_symbolic_length_the_cache_is_still_written_in_place():
    """Exported with the cache's length symbolic (as pxrt exports a decoder), jax
    indexes ``cache[:, i]`` with a gather rather than a slice: read as the same view."""
    from jax import export

    params, cache, tokens, positions = _inputs()
    slots, length = export.symbolic_shape("slots, length")
    spec = jax.ShapeDtypeStruct((slots, LAYERS, 2, length, HEADS, DIM), jnp.float32)
    ints = jax.ShapeDtypeStruct((slots,), jnp.int32)
    texts = {}
    for name, step in (("plain", keras_like), ("in place", in_place(keras_like, 1))):
        exported = export.export(jax.jit(per_slot(step)))(params, spec, ints, ints)
        texts[name] = exported.mlir_module()
        got = exported.call(params, cache, tokens, positions)
        want = jax.jit(per_slot(keras_like))(params, cache, tokens, positions)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)

    def float_joins(text: str) -> int:  # (shape arithmetic concatenates integers)
        return sum("concatenate" in line and "xf32>" in line for line in text.splitlines())

    assert float_joins(texts["plain"]) > 0
    assert float_joins(texts["in place"]) == 0


def test_a_repeat_into_a_dot_is_read_grouped():
    """Grouped-query attention as keras-hub writes it: each key and value head
    repeated for its group of query heads (``jnp.repeat``), then einsums over the
    heads. The dots read the unrepeated heads, the query's heads split into groups:
    the same values, no repeated copy. A repeat used otherwise too is made."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 3, 6, 4)), jnp.float32)  # 6 heads
    cache = jnp.asarray(rng.standard_normal((2, 1, 5, 2, 4)), jnp.float32)  # 2 kv heads

    def attend(q, cache, also):
        key, value = jnp.repeat(cache[0], 3, axis=2), jnp.repeat(cache[1], 3, axis=2)
        scores = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, key), axis=-1)
        out = jnp.einsum("BNTS,BSNH->BTNH", scores, value)
        return (out, value * 2) if also else out

    for also in (False, True):
        step = functools.partial(attend, also=also)
        got, want = jax.jit(in_place(step, 1))(q, cache), step(q, cache)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        eqns = jax.make_jaxpr(in_place(step, 1))(q, cache).jaxpr.eqns
        repeated = [
            e
            for e in eqns
            if e.primitive.name == "reshape" and e.outvars[0].aval.shape == (1, 5, 6, 4)
        ]
        assert len(repeated) == (1 if also else 0)  # (the value's, for its other use)
