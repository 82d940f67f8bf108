"""The built-in demo model: a 3-layer GELU MLP, 256 wide, float32."""

from __future__ import annotations

import numpy as np

from .artifact import TensorSpec

WIDTH = 256
LAYERS = 3
BUCKETS = (1, 8, 64, 256)


def mlp(params, x):
    """``x: [n, 256] -> {"y": [n, 256]}``."""
    import jax

    for w, b in params:
        x = jax.nn.gelu(x @ w + b)
    return {"y": x}


def make_params(seed: int = 0, width: int = WIDTH, layers: int = LAYERS) -> list:
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
            (0.1 * rng.standard_normal(width)).astype(np.float32),
        )
        for _ in range(layers)
    ]


def spec(width: int = WIDTH, layers: int = LAYERS) -> dict:
    """The demo model as ``pxrt export`` takes a model: ``pxrt export pxrt.demo:spec DIR``."""
    return {
        "fn": mlp,
        "params": make_params(width=width, layers=layers),
        "inputs": {"x": TensorSpec((width,), "float32")},
        "batch_buckets": BUCKETS,
        "name": "mlp",
    }


def export_demo(
    path: str,
    *,
    buckets=BUCKETS,
    width: int = WIDTH,
    layers: int = LAYERS,
    overwrite: bool = True,
) -> str:
    """Export the demo MLP (``layers`` x ``width``) to ``path``."""
    from .artifact import export

    return export(
        mlp,
        make_params(width=width, layers=layers),
        path,
        inputs={"x": TensorSpec((width,), "float32")},
        batch_buckets=buckets,
        name="mlp",
        overwrite=overwrite,
    )


# --------------------------------------------------------------------------- encoder
# A small transformer encoder for variable-length inputs: token embedding plus
# sinusoidal positions, pre-norm layers of masked multi-head self-attention and a GELU
# MLP, then masked mean pooling. Padded positions never reach a valid one: they are
# masked out of every attention and of the pooling.

ENC_VOCAB = 1024
ENC_DIM = 64
ENC_HEADS = 4
ENC_LAYERS = 2
ENC_SEQ_BUCKETS = (32, 64, 128, 256)
ENC_BATCH_BUCKETS = (1, 8, 32)


def encoder(params, tokens, mask):
    """``tokens: int32[n, seq]``, ``mask: bool[n, seq]`` (True where a token is) ->
    ``{"hidden": float32[n, seq, dim], "pooled": float32[n, dim]}``."""
    import jax
    import jax.numpy as jnp

    dim = params["embed"].shape[1]
    heads = params["layers"][0]["heads"].shape[0]
    x = params["embed"][tokens] + _positions(tokens.shape[1], dim)
    keep = mask[:, None, None, :]  # [n, 1, 1, keys]
    for layer in params["layers"]:
        h = _layer_norm(x, layer["ln1"])
        qkv = h @ layer["qkv"]  # [n, seq, 3 * dim]
        q, k, v = (
            t.reshape(t.shape[0], t.shape[1], heads, dim // heads)
            for t in jnp.split(qkv, 3, axis=-1)
        )
        logits = jnp.einsum("nqhd,nkhd->nhqk", q, k) / jnp.sqrt(dim // heads).astype(x.dtype)
        logits = jnp.where(keep, logits, jnp.finfo(x.dtype).min)
        attn = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("nhqk,nkhd->nqhd", attn, v).reshape(x.shape)
        x = x + out @ layer["out"]
        h = _layer_norm(x, layer["ln2"])
        x = x + jax.nn.gelu(h @ layer["ff1"]) @ layer["ff2"]
    x = _layer_norm(x, params["ln_final"])
    weights = mask[..., None].astype(x.dtype)
    pooled = (x * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1.0)
    return {"hidden": x, "pooled": pooled}


def _positions(length, dim: int):
    import jax.numpy as jnp

    pos = jnp.arange(length, dtype=jnp.float32)[:, None]
    freq = jnp.exp(-jnp.log(10000.0) * jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = pos * freq[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def _layer_norm(x, scale):
    import jax.numpy as jnp

    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * scale


def make_encoder_params(
    seed: int = 0,
    vocab: int = ENC_VOCAB,
    dim: int = ENC_DIM,
    heads: int = ENC_HEADS,
    layers: int = ENC_LAYERS,
) -> dict:
    rng = np.random.default_rng(seed)

    def dense(fan_in: int, fan_out: int) -> np.ndarray:
        return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)

    return {
        "embed": (0.5 * rng.standard_normal((vocab, dim))).astype(np.float32),
        "layers": [
            {
                "ln1": np.ones(dim, np.float32),
                "qkv": dense(dim, 3 * dim),
                "out": dense(dim, dim),
                "ln2": np.ones(dim, np.float32),
                "ff1": dense(dim, 2 * dim),
                "ff2": dense(2 * dim, dim),
                # Carries the head count into the params (its shape), nothing else.
                "heads": np.zeros(heads, np.float32),
            }
            for _ in range(layers)
        ],
        "ln_final": np.ones(dim, np.float32),
    }


def encoder_inputs() -> dict:
    return {
        "tokens": TensorSpec(("seq",), "int32"),
        "mask": TensorSpec(("seq",), "bool", pad=False),
    }


def encoder_spec() -> dict:
    """The demo encoder as ``pxrt export`` takes a model: ``pxrt export
    pxrt.demo:encoder_spec DIR``."""
    return {
        "fn": encoder,
        "params": make_encoder_params(),
        "inputs": encoder_inputs(),
        "batch_buckets": ENC_BATCH_BUCKETS,
        "dim_buckets": {"seq": ENC_SEQ_BUCKETS},
        "name": "encoder",
    }


def export_encoder(
    path: str,
    *,
    batch_buckets=ENC_BATCH_BUCKETS,
    seq_buckets=ENC_SEQ_BUCKETS,
    overwrite: bool = True,
    **sizes: int,
) -> str:
    """Export the demo encoder to ``path`` (``sizes``: vocab, dim, heads, layers)."""
    from .artifact import export

    return export(
        encoder,
        make_encoder_params(**sizes),
        path,
        inputs=encoder_inputs(),
        batch_buckets=batch_buckets,
        dim_buckets={"seq": seq_buckets},
        name="encoder",
        overwrite=overwrite,
    )


def token_lengths(
    n: int, low: int = 8, high: int = 256, seed: int = 0, shape: float = 1.2
) -> np.ndarray:
    """``n`` request lengths from a long-tailed (Pareto) distribution on
    ``[low, high]``: most short, a few long, as text lengths are."""
    rng = np.random.default_rng(seed)
    lengths = low * (1.0 + rng.pareto(shape, n))
    return np.clip(np.round(lengths), low, high).astype(np.int64)


def encoder_request(rows: int, length: int, seed: int = 0, vocab: int = ENC_VOCAB) -> dict:
    """A request of ``rows`` sequences of ``length`` tokens (all valid)."""
    rng = np.random.default_rng(seed)
    return {
        "tokens": rng.integers(0, vocab, (rows, length), dtype=np.int32),
        "mask": np.ones((rows, length), bool),
    }
