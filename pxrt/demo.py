"""The built-in demo model: a 3-layer GELU MLP, 256 wide, float32."""

from __future__ import annotations

import functools

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


# --------------------------------------------------------------------------- decoder
# A small decoder-only transformer over bytes (256 byte tokens, then BOS and EOS) with a
# KV cache, for generation: ``lm_prefill`` runs a padded batch of prompts with causal
# attention and returns their cache rows and next-token logits; ``lm_decode`` runs one
# token for every slot, writing its keys and values at its position and attending to
# the positions up to it. Weights are random; the output head is scaled up so that
# greedy decoding has clear winners (a demo of the runtime, not of language).

LM_VOCAB = 258
LM_BOS, LM_EOS = 256, 257
LM_DIM = 64
LM_HEADS = 4
LM_LAYERS = 2
LM_MAX_LENGTH = 256
LM_SLOTS = 8
LM_PREFILL_LENGTHS = (16, 32, 64, 128)
LM_PREFILL_BATCHES = (1, 4)
# Messages as "<|role|>content" lines; the assistant's turn opened at the end.
LM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def lm_cache_spec(layers: int = LM_LAYERS, heads: int = LM_HEADS, dim: int = LM_DIM) -> dict:
    """The per-slot KV cache: keys and values per layer, position, head."""
    kv = TensorSpec((layers, "length", heads, dim // heads), "float32")
    return {"k": kv, "v": kv}


def _lm_block(layer, x, heads, attend):
    import jax
    import jax.numpy as jnp

    h = _layer_norm(x, layer["ln1"])
    q, k, v = jnp.split(h @ layer["qkv"], 3, axis=-1)
    split = x.shape[:-1] + (heads, x.shape[-1] // heads)
    out, k, v = attend(q.reshape(split), k.reshape(split), v.reshape(split))
    x = x + out.reshape(x.shape) @ layer["out"]
    h = _layer_norm(x, layer["ln2"])
    return x + jax.nn.gelu(h @ layer["ff1"]) @ layer["ff2"], k, v


def _attention(q, k, v, keep, spec):
    import jax
    import jax.numpy as jnp

    scale = 1.0 / np.sqrt(q.shape[-1]).astype(np.float32)
    logits = jnp.einsum(spec[0], q, k) * scale
    weights = jax.nn.softmax(jnp.where(keep, logits, -1e30), axis=-1)
    return jnp.einsum(spec[1], weights, v)


def lm_prefill(params, tokens, lengths):
    """``tokens: int32[b, seq]`` (padded), ``lengths: int32[b]`` -> (cache rows
    ``{"k", "v": [b, layers, seq, heads, hd]}``, logits ``[b, vocab]`` after each
    prompt's last token)."""
    import jax.numpy as jnp

    heads = params["layers"][0]["heads"].shape[0]
    dim = params["embed"].shape[1]
    seq = jnp.arange(tokens.shape[1])
    x = params["embed"][tokens] + _positions(tokens.shape[1], dim)[None]
    # Causal, and no key past a prompt's end (its padding).
    keep = (seq[None, :] <= seq[:, None])[None, None] & (seq < lengths[:, None])[:, None, None, :]
    ks, vs = [], []
    for layer in params["layers"]:

        def attend(q, k, v):
            return _attention(q, k, v, keep, ("nqhd,nkhd->nhqk", "nhqk,nkhd->nqhd")), k, v

        x, k, v = _lm_block(layer, x, heads, attend)
        ks.append(k)
        vs.append(v)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = _layer_norm(last, params["ln_final"]) @ params["head"]
    return {"k": jnp.stack(ks, axis=1), "v": jnp.stack(vs, axis=1)}, logits


def lm_decode(params, cache, tokens, positions):
    """One step for every slot: ``tokens``, ``positions``: ``int32[slots]``; the cache
    ``{"k", "v": [slots, layers, length, heads, hd]}`` -> (cache, logits ``[slots,
    vocab]``)."""
    import jax.numpy as jnp

    heads = params["layers"][0]["heads"].shape[0]
    dim = params["embed"].shape[1]
    slots = jnp.arange(tokens.shape[0])
    keep = (jnp.arange(cache["k"].shape[2])[None, :] <= positions[:, None])[:, None, :]
    x = params["embed"][tokens] + _positions_at(positions, dim)
    kc, vc = cache["k"], cache["v"]
    for i, layer in enumerate(params["layers"]):

        def attend(q, k, v, i=i):
            nonlocal kc, vc
            kc = kc.at[slots, i, positions].set(k)
            vc = vc.at[slots, i, positions].set(v)
            out = _attention(q, kc[:, i], vc[:, i], keep, ("shd,slhd->shl", "shl,slhd->shd"))
            return out, k, v

        x, _, _ = _lm_block(layer, x, heads, attend)
    logits = _layer_norm(x, params["ln_final"]) @ params["head"]
    return {"k": kc, "v": vc}, logits


def lm_extend(params, cache, tokens, positions):
    """``k`` tokens for every row at once: ``tokens: int32[rows, k]``, token ``j`` of a
    row at position ``positions[row] + j``, attending to the row's cache up to itself;
    the cache ``{"k", "v": [rows, layers, length, heads, hd]}`` -> (cache, logits
    ``[rows, k, vocab]``). Decode is the case ``k = 1``; a chunk of a long prompt, or
    the rest of a prompt whose start is cached, is another."""
    import jax.numpy as jnp

    heads = params["layers"][0]["heads"].shape[0]
    dim = params["embed"].shape[1]
    rows, k = tokens.shape
    at = positions[:, None] + jnp.arange(k)[None, :]  # [rows, k]
    row = jnp.arange(rows)[:, None]
    keep = (jnp.arange(cache["k"].shape[2])[None, None, :] <= at[:, :, None])[:, None]
    x = params["embed"][tokens] + _positions_at(at.reshape(-1), dim).reshape(rows, k, dim)
    kc, vc = cache["k"], cache["v"]
    for i, layer in enumerate(params["layers"]):

        def attend(q, k, v, i=i):
            nonlocal kc, vc
            kc = kc.at[row, i, at].set(k)
            vc = vc.at[row, i, at].set(v)
            out = _attention(q, kc[:, i], vc[:, i], keep, ("rqhd,rlhd->rhql", "rhql,rlhd->rqhd"))
            return out, k, v

        x, _, _ = _lm_block(layer, x, heads, attend)
    logits = _layer_norm(x, params["ln_final"]) @ params["head"]
    return {"k": kc, "v": vc}, logits


def _positions_at(positions, dim: int):
    import jax.numpy as jnp

    freq = jnp.exp(-jnp.log(10000.0) * jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = positions.astype(jnp.float32)[:, None] * freq[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def make_lm_params(
    seed: int = 0,
    vocab: int = LM_VOCAB,
    dim: int = LM_DIM,
    heads: int = LM_HEADS,
    layers: int = LM_LAYERS,
) -> dict:
    params = make_encoder_params(seed, vocab, dim, heads, layers)
    rng = np.random.default_rng(seed + 1)
    params["embed"] = rng.standard_normal((vocab, dim)).astype(np.float32)
    params["head"] = (3.0 * rng.standard_normal((dim, vocab))).astype(np.float32)
    return params


def export_lm(
    path: str,
    *,
    slots: int = LM_SLOTS,
    max_length: int = LM_MAX_LENGTH,
    prefill_lengths=LM_PREFILL_LENGTHS,
    prefill_batches=LM_PREFILL_BATCHES,
    chunk_lengths=None,
    extend: bool = True,
    bounds: dict[str, int | None] | None = None,
    overwrite: bool = True,
    **sizes: int,
) -> str:
    """Export the demo decoder to ``path`` (``sizes``: dim, heads, layers; ``bounds`` as
    for ``export_decoder``; ``extend`` False: without its multi-token step, whose
    ``chunk_lengths`` default to the shortest and the longest prefill length: a long
    prompt goes in the longest at a time, the rest of one whose start is cached in the
    shortest that holds it)."""
    if chunk_lengths is None:
        chunk_lengths = sorted({min(prefill_lengths), max(prefill_lengths)})
    from .decoder import export_decoder

    return export_decoder(
        lm_prefill,
        lm_decode,
        make_lm_params(**sizes),
        path,
        cache=lm_cache_spec(
            sizes.get("layers", LM_LAYERS), sizes.get("heads", LM_HEADS), sizes.get("dim", LM_DIM)
        ),
        max_length=max_length,
        slots=slots,
        prefill_lengths=prefill_lengths,
        prefill_batches=prefill_batches,
        extend=lm_extend if extend else None,
        chunk_lengths=chunk_lengths if extend else None,
        eos_id=LM_EOS,
        tokenizer="bytes",
        chat_template=LM_CHAT_TEMPLATE,
        name="lm",
        bounds=bounds,
        overwrite=overwrite,
    )


def lm_reference(
    prompt,
    max_tokens: int,
    params=None,
    max_length: int = LM_MAX_LENGTH,
    stop_ids=(LM_EOS,),
) -> list[int]:
    """Greedy decoding of one prompt in plain JAX with ``lm_prefill`` and ``lm_decode``
    (one prompt, padded to a power of two, a one-slot cache): what pxrt's generation is
    checked against. ``params`` default to ``make_lm_params()``."""
    return lm_reference_steps(prompt, max_tokens, params, max_length, stop_ids)[0]


def lm_reference_steps(
    prompt,
    max_tokens: int,
    params=None,
    max_length: int = LM_MAX_LENGTH,
    stop_ids=(LM_EOS,),
    choose=None,
) -> tuple[list[int], list[np.ndarray]]:
    """``lm_reference``'s decoding, each token picked by ``choose(logits, tokens)``
    (the step's float32 logits and the tokens so far; default: argmax): (the tokens,
    the logits each was picked from)."""
    import jax.numpy as jnp

    if params is None:
        params = make_lm_params()
    if choose is None:

        def choose(logits, tokens):
            return int(np.argmax(logits))

    prefill, decode = _lm_jitted()
    n = len(prompt)
    # Padded to a power of two (at least 8) with ``lengths`` saying where it ends, as
    # prefill's contract allows: a reference per prompt length would compile per length.
    # The rows past the prompt are masked until decode writes them.
    width = min(max(8, 1 << (n - 1).bit_length()), max_length)
    padded = np.zeros((1, max(width, n)), np.int32)
    padded[0, :n] = prompt
    rows, logits = prefill(params, jnp.asarray(padded), jnp.asarray([n], jnp.int32))
    cache = {
        k: jnp.zeros(r.shape[:2] + (max_length,) + r.shape[3:], r.dtype)
        .at[:, :, : r.shape[2]]
        .set(r)
        for k, r in rows.items()
    }
    seen = [np.asarray(logits[0], np.float32)]
    tokens = [choose(seen[-1], [])]
    limit = min(max_tokens, max_length - n)
    while len(tokens) < limit and tokens[-1] not in stop_ids:
        position = jnp.asarray([n + len(tokens) - 1], jnp.int32)
        cache, logits = decode(params, cache, jnp.asarray([tokens[-1]], jnp.int32), position)
        seen.append(np.asarray(logits[0], np.float32))
        tokens.append(choose(seen[-1], list(tokens)))
    return tokens, seen


@functools.cache
def _lm_jitted():
    import jax

    return jax.jit(lm_prefill), jax.jit(lm_decode)


def lm_prompts(n: int, seed: int = 0, low: int = 4, high: int = 128) -> list[np.ndarray]:
    """``n`` byte prompts with long-tailed lengths in ``[low, high]``."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(32, 127, int(length), dtype=np.int32)
        for length in token_lengths(n, low, high, seed)
    ]
