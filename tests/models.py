"""Test models: each a function, its params and its input specs, plus plain-JAX references."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import pxrt


def mlp(params, x):
    for w, b in params:
        x = jax.nn.gelu(x @ w + b)
    return {"y": x}


def mlp_params(width=32, layers=2, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
            (0.1 * rng.standard_normal(width)).astype(np.float32),
        )
        for _ in range(layers)
    ]


def two_io(params, tokens, features):
    """Two inputs of different dtypes (int32 ids, float16 features), two outputs."""
    emb = params["emb"][tokens]  # [n, seq, d]
    pooled = emb.mean(axis=1)  # [n, d]
    h = pooled + features.astype(jnp.float32) @ params["proj"]
    return {"scores": h @ params["head"], "argmax": jnp.argmax(h, axis=-1).astype(jnp.int32)}


def two_io_params(seed=1):
    rng = np.random.default_rng(seed)
    return {
        "emb": rng.standard_normal((50, 16)).astype(np.float32),
        "proj": rng.standard_normal((8, 16)).astype(np.float32),
        "head": rng.standard_normal((16, 3)).astype(np.float32),
    }


def bf16_model(params, x):
    h = jnp.tanh(x @ params["w"])
    return h.astype(jnp.bfloat16)  # a single output: named "output"


def bf16_params(seed=2):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)}


def all_dtypes(params, f32, f16, bf16, i32, i64, u8, flag):
    """One input and one output of every dtype pxrt promises, each transformed."""
    return {
        "f32": f32 * params["scale"] + 1.0,
        "f16": f16 * jnp.float16(2),
        "bf16": bf16 + jnp.asarray(1, jnp.bfloat16),
        "i32": i32 * 3 - 7,
        "i64": i64 + jnp.int64(2**31 + 5),  # wraps if anything narrows to int32
        "u8": u8 ^ jnp.uint8(0x5A),
        "flag": jnp.logical_not(flag),
    }


ALL_DTYPES_INPUTS = {
    "f32": pxrt.TensorSpec((3,), "float32"),
    "f16": pxrt.TensorSpec((2,), "float16"),
    "bf16": pxrt.TensorSpec((2,), "bfloat16"),
    "i32": pxrt.TensorSpec((), "int32"),
    "i64": pxrt.TensorSpec((2,), "int64"),
    "u8": pxrt.TensorSpec((4,), "uint8"),
    "flag": pxrt.TensorSpec((1,), "bool"),
}

MODELS = {
    "mlp": dict(
        fn=mlp,
        params=mlp_params,
        inputs={"x": pxrt.TensorSpec((32,), "float32")},
        buckets=(1, 8, 16),
    ),
    "two_io": dict(
        fn=two_io,
        params=two_io_params,
        inputs={
            "tokens": pxrt.TensorSpec((5,), "int32"),
            "features": pxrt.TensorSpec((8,), "float16"),
        },
        buckets=(4, 8),
    ),
    "bf16": dict(
        fn=bf16_model,
        params=bf16_params,
        inputs={"x": pxrt.TensorSpec((16,), "bfloat16")},
        buckets=(2, 8),
    ),
    "all_dtypes": dict(
        fn=all_dtypes,
        params=lambda: {"scale": np.float32(1.5)},
        inputs=ALL_DTYPES_INPUTS,
        buckets=(4, 8),
    ),
}


def random_request(inputs, rows, rng):
    """A valid request of ``rows`` rows (including extreme int64 values)."""
    out = pxrt.example_inputs(inputs, rows, seed=int(rng.integers(1 << 30)))
    for name, spec in inputs.items():
        if spec.dtype == np.int64:
            out[name] = out[name] + np.int64(2**40)
        if name == "tokens":
            out[name] = rng.integers(0, 50, (rows,) + spec.shape).astype(np.int32)
    return out


def reference(name, request):
    """Plain jax.jit on one device with x64 as the export used it."""
    spec = MODELS[name]
    x64 = any(s.dtype.itemsize == 8 for s in spec["inputs"].values())
    with jax.enable_x64(x64):
        out = jax.jit(spec["fn"])(spec["params"](), **request)
        out = out if isinstance(out, dict) else {"output": out}
        return {k: np.asarray(v) for k, v in out.items()}


def assert_matches(got, want, name=""):
    assert set(got) == set(want), (name, set(got), set(want))
    for k in want:
        g, w = np.asarray(got[k]), want[k]
        assert g.dtype == w.dtype, (name, k, g.dtype, w.dtype)
        assert g.shape == w.shape, (name, k, g.shape, w.shape)
        if np.issubdtype(w.dtype, np.floating) or w.dtype == ml_dtypes.bfloat16:
            # Sharding changes reduction order: allow float rounding, nothing more.
            np.testing.assert_allclose(
                g.astype(np.float32),
                w.astype(np.float32),
                rtol=2e-2 if w.itemsize == 2 else 1e-5,
                atol=2e-2 if w.itemsize == 2 else 1e-5,
                err_msg=f"{name}:{k}",
            )
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{name}:{k}")


async def until(condition, timeout_s: float = 30.0) -> None:
    """Poll ``condition()`` from the event loop until it holds: what tests wait on
    instead of a sleep that guesses how long something takes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, f"timed out after {timeout_s} s waiting"
        await asyncio.sleep(0.005)


class Gate:
    """What the programs of ``inject`` share: ``started`` is set when a batch reaches
    "the device"; with ``hold``, every batch waits there until ``release`` is set. Tests
    wait on these instead of sleeping."""

    def __init__(self, hold: bool) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.batches = 0

    async def wait_started(self) -> None:
        """Until a batch is on the device (from the event loop)."""
        assert await asyncio.to_thread(self.started.wait, 30), "no batch started"


class Wrapped:
    """A bucket program that can hold, slow down or fail a batch, and counts batches."""

    def __init__(self, real, gate, delay_s=0.0, fail_if=None):
        self.real, self.gate, self.delay_s, self.fail_if = real, gate, delay_s, fail_if
        self.path = real.path
        self.out_shard_rows, self.row_slices = real.out_shard_rows, real.row_slices

    def dispatch(self, slot):
        self.gate.batches += 1
        self.gate.started.set()
        assert self.gate.release.wait(30), "the test never released its batches"
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail_if is not None and self.fail_if(slot):
            raise RuntimeError("injected device failure")
        return self.real.dispatch(slot)

    def fetch(self, handle):
        return self.real.fetch(handle)


@contextlib.contextmanager
def inject(model, *, hold=False, delay_s=0.0, fail_if=None):
    """Within the block, every bucket of ``model`` runs through a ``Wrapped`` program
    (serve it inside the block); yields their ``Gate``. The model's own engine is back
    afterwards, so session models can be used (nothing recompiles)."""
    gate = Gate(hold)
    real = model.engine
    model.engine = real.replace_programs(lambda p: Wrapped(p, gate, delay_s, fail_if))
    try:
        yield gate
    finally:
        gate.release.set()
        model.engine = real


# --------------------------------------------------------------------------- named dims


def ragged(params, x, w):
    """A named dimension that is not the first (x: [n, 3, seq]), a non-zero pad value
    (x pads with -1024: the max ignores it), outputs cut along axis 2 and axis 1, and
    one without the dimension."""
    return {"y": x * params["k"], "m": x.max(axis=2), "c": jnp.cumsum(w, axis=1)}


RAGGED = dict(
    fn=ragged,
    params=lambda: {"k": np.float32(2.0)},
    inputs={
        "x": pxrt.TensorSpec((3, "seq"), "float32", pad=-1024.0),
        "w": pxrt.TensorSpec(("seq",), "int32"),
    },
    buckets=(1, 4),
    dim_buckets={"seq": (4, 8)},
)

# The demo encoder, small: a few cells compile in seconds.
ENCODER_SIZES = dict(vocab=64, dim=16, heads=2, layers=1)
ENCODER = dict(buckets=(1, 4), dim_buckets={"seq": (8, 16, 32)})


def ragged_request(rows, length, rng):
    return {
        "x": rng.uniform(-10, 10, (rows, 3, length)).astype(np.float32),
        "w": rng.integers(-50, 50, (rows, length)).astype(np.int32),
    }


def ragged_reference(request):
    out = jax.jit(ragged)(RAGGED["params"](), **request)
    return {k: np.asarray(v) for k, v in out.items()}


@functools.cache
def _encoder_jax():
    from pxrt import demo

    return jax.jit(demo.encoder), demo.make_encoder_params(**ENCODER_SIZES)


def encoder_reference(request):
    """Plain JAX's outputs of the demo encoder for ``request`` (compiled per shape)."""
    fn, params = _encoder_jax()
    out = fn(params, **request)
    return {k: np.asarray(v) for k, v in out.items()}
