"""Sampling on the device, per row, and the layout of the per-row parameters that the
decoder's programs read (``pxrt.generate`` writes them; ``pxrt.decoder_load`` builds the
programs).

Greedy, temperature, top-k, top-p: a sampled token's randomness comes from
``fold_in(key(seed), position)`` only, so a request with a seed gets the same tokens
whatever else shares the batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

#: Temperatures below this are greedy (dividing by them would overflow float32).
MIN_TEMPERATURE = 1e-5
#: The highest temperature taken: the logits are divided by it in float32 (1e300 would
#: overflow to a uniform draw), and beyond it sampling is near uniform already.
MAX_TEMPERATURE = 100.0

# Columns of the per-prompt int32 and float32 rows of a prefill call, and of the state's
# per-slot rows (the same float columns; ints: the next input token and its position
# where a prompt has its length and slot).
LEN, SLOT, TOPK, SEED = range(4)
TOK, POS = LEN, SLOT
TEMP, TOPP = range(2)
# Columns of an extend call's int32 rows (a chunk of a prompt, for one slot): the
# position of its first token, how many of its tokens are the prompt's, the slot,
# top-k, seed bits, and whether it ends the prompt (1: sample the first token and let
# the slot join the steps; 0: the slot stays parked, out of the steps' way).
CHUNK_START, CHUNK_COUNT, CHUNK_SLOT, CHUNK_TOPK, CHUNK_SEED, CHUNK_FINAL = range(6)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed: jax.Array,
    position: jax.Array,
) -> jax.Array:
    """One token per row of ``logits`` ``[n, vocab]``, each row by its own parameters:
    ``temperature`` below ``MIN_TEMPERATURE`` is greedy (argmax); otherwise the logits
    are divided by it, cut to the ``top_k`` largest (0: all) and to the smallest set
    whose probability reaches ``top_p`` (1: all), and drawn with the key
    ``fold_in(key(seed), position)``. Shapes are fixed (a sort per row), so it compiles
    once; all-greedy batches skip the draw."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    sampled = temperature >= MIN_TEMPERATURE

    def draw(_: Any) -> jax.Array:
        scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
        desc = -jnp.sort(-scaled, axis=-1)
        k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        in_k = jnp.arange(vocab)[None, :] < k[:, None]
        probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        in_p = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        kept = jnp.maximum((in_k & in_p).sum(axis=-1), 1)
        cut = jnp.take_along_axis(desc, (kept - 1)[:, None], axis=-1)
        masked = jnp.where(scaled >= cut, scaled, -jnp.inf)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)
        noise = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
        return jnp.argmax(masked + noise, axis=-1).astype(jnp.int32)

    drawn = lax.cond(jnp.any(sampled), draw, lambda _: greedy, None)
    return jnp.where(sampled, drawn, greedy)
