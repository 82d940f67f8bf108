"""Sampling on the device, per row, and the layout of the per-row parameters that the
decoder's programs read (``pxrt.decoder.runner`` writes them; ``pxrt.decoder.programs`` builds
the programs).

Greedy, temperature, top-k, top-p: a sampled token's randomness comes from
``fold_in(key(seed), position)`` only, so a request with a seed gets the same tokens
whatever else shares the batch.

The controls a request may add, applied to its row's logits before sampling
(``controls``): ``logit_bias``, the repetition penalty (over the prompt's and the
generated tokens), the presence and frequency penalties (over the generated ones), and
``min_tokens`` (its stop ids banned until then). Log-probabilities (``scores``) are of
the model's own distribution, before any of them: a log-softmax of its logits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

# The limits a request is checked against (``pxrt.decoder.params``: no jax there).
from .decoder.params import (  # noqa: F401 - re-exported
    MAX_BANNED,
    MAX_LOGIT_BIAS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
)

# Columns of the per-prompt int32 and float32 rows of a prefill call, and of the state's
# per-slot rows (the same float columns; ints: the next input token and its position
# where a prompt has its length and slot).
# After them, in both: whether the row wants log-probabilities (``scores``), whether its
# controls apply (``controls``; the state's control rows were written for its slot),
# and the position before which its stop ids are banned (``min_tokens``).
LEN, SLOT, TOPK, SEED, WANT, CTRL, UNTIL = range(7)
TOK, POS = LEN, SLOT
INTS = 7
# Floats: temperature, top-p, and the presence, frequency and repetition penalties.
TEMP, TOPP, PRESENCE, FREQUENCY, REPETITION = range(5)
FLOATS = 5
# Columns of an extend call's int32 rows (a chunk of a prompt, for one slot): the
# position of its first token, how many of its tokens are the prompt's, the slot,
# top-k, seed bits, and whether it ends the prompt (1: sample the first token and let
# the slot join the steps; 0: the slot stays parked, out of the steps' way); then
# WANT, CTRL and UNTIL as above.
CHUNK_START, CHUNK_COUNT, CHUNK_SLOT, CHUNK_TOPK, CHUNK_SEED, CHUNK_FINAL = range(6)
CHUNK_WANT, CHUNK_CTRL, CHUNK_UNTIL = range(6, 9)
# Then whether the row wants its prompt's scores (``prompt_logprobs``) and the prompt's
# token after the chunk (the last position's next token; 0 past the prompt).
CHUNK_PROMPT, CHUNK_NEXT = 9, 10
CHUNK_INTS = 11


def greedy(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as int32, the same index (the first of a row's
    largest; the first NaN where there is one) by two plain reductions: XLA:CPU runs
    argmax's variadic (value, index) reduce element by element, 2-4x the time of a
    max and a masked min (32 rows of 258 logits: 78-142 against 37 us; 64 rows of
    32,000: 4.9 against 2.7 ms), a share of a small model's step."""
    top = logits.max(axis=-1, keepdims=True)  # (NaN where a row has one)
    index = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


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
    whose probability reaches ``top_p`` (1: all), and drawn by one uniform number from
    the key ``fold_in(key(seed), position)`` (the inverse of the kept tokens'
    cumulative weights). Shapes are fixed, so it compiles once; all-greedy batches skip
    the draw."""
    logits = logits.astype(jnp.float32)
    most = greedy(logits)
    vocab = logits.shape[-1]
    sampled = temperature >= MIN_TEMPERATURE

    def draw(_: Any) -> jax.Array:
        scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
        k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        cut = _cut(scaled, k, top_p)
        # One uniform per row and the inverse of the kept tokens' cumulative weights (a
        # Gumbel draw takes a random number per token: 2.6x the time at 32,000 tokens).
        weights = jnp.where(
            scaled >= cut[:, None], jnp.exp(scaled - scaled.max(axis=-1, keepdims=True)), 0.0
        )
        cumulative = jnp.cumsum(weights, axis=-1)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)
        # (in (0, 1]: the token drawn has a weight above zero)
        u = 1.0 - jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
        drawn = (cumulative < u[:, None] * cumulative[:, -1:]).sum(axis=-1)
        return jnp.minimum(drawn, vocab - 1).astype(jnp.int32)

    drawn = lax.cond(jnp.any(sampled), draw, lambda _: most, None)
    return jnp.where(sampled, drawn, most)


#: How many of a row's largest logits the top-k / top-p cut is looked for in first
#: (``lax.top_k``); only when a row's cut lies beyond them is the whole row sorted (on
#: XLA:CPU a sort of 16 rows of 32,000 logits takes ~90 ms: 25x the step around it).
CUT_CANDIDATES = 256


def _cut(scaled: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Each row's smallest kept logit: of its ``k`` largest (``k`` = vocab: all), the
    fewest whose probability (renormalised over the ``k``) reaches ``top_p``; -inf when
    nothing is cut. Looked for among the ``CUT_CANDIDATES`` largest; the whole rows are
    sorted only when some row's cut lies beyond them."""
    vocab = scaled.shape[-1]
    whole = k >= vocab
    none = whole & (top_p >= 1.0)
    # (the row's max, not ``desc[:, 0]``: a second slice of ``top_k``'s sort makes
    # XLA:CPU keep the whole sort, not its top-k: 35x the time, measured)
    top = scaled.max(axis=-1)

    def cut_in(desc: jax.Array, total: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """(the cut, whether it lies in ``desc``, a row's largest logits in descending
        order; ``total``: the sum of a whole row's exponentials, where ``desc`` is not
        all of it)."""
        w = desc.shape[-1]
        in_k = jnp.arange(w)[None, :] < k[:, None]
        e = jnp.where(in_k, jnp.exp(desc - top[:, None]), 0.0)
        denominator = e.sum(axis=-1) if total is None else jnp.where(whole, total, e.sum(axis=-1))
        probs = e / denominator[:, None]
        reach = jnp.cumsum(probs, axis=-1)
        in_p = (reach - probs < top_p[:, None]) | (top_p[:, None] >= 1.0)
        kept = jnp.maximum((in_k & in_p).sum(axis=-1), 1)
        cut = jnp.take_along_axis(desc, (kept - 1)[:, None], axis=-1)[:, 0]
        last = jnp.take_along_axis(reach, (jnp.minimum(k, w) - 1)[:, None], axis=-1)[:, 0]
        found = none | (k <= w) & ((top_p >= 1.0) | (last >= top_p))
        return jnp.where(none, -jnp.inf, cut), found

    def sorted_cut(_: Any) -> jax.Array:
        return cut_in(-jnp.sort(-scaled, axis=-1), None)[0]

    width = min(vocab, CUT_CANDIDATES)
    if width == vocab:
        return sorted_cut(None)

    def candidates(_: Any) -> jax.Array:
        desc = lax.top_k(scaled, width)[0]
        total = jnp.exp(scaled - top[:, None]).sum(axis=-1)
        cut, found = cut_in(desc, total)
        return lax.cond(jnp.all(found), lambda _: cut, sorted_cut, None)

    uncut = jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype)
    return lax.cond(jnp.all(none), lambda _: uncut, candidates, None)


def top_count(vocab: int) -> int:
    """The alternatives ``scores`` gives per token for a vocabulary of ``vocab``."""
    return min(MAX_TOP_LOGPROBS, vocab)


def scores(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Per row of ``logits`` ``[n, vocab]``: the log-probability of ``tokens[n]`` and the
    ``top_count`` most likely tokens' (a log-softmax of the logits, in float32), packed
    as ``[n, 1 + 2 * top]`` float32: the token's, the top ones' log-probabilities, then
    their ids (exact in float32 below 2**24). ``unpack`` reads a row."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)
    values, ids = lax.top_k(logp, top_count(logits.shape[-1]))
    return jnp.concatenate([chosen, values, ids.astype(jnp.float32)], axis=-1)


def prompt_scores(logits: jax.Array, tokens: jax.Array, want: jax.Array) -> jax.Array:
    """``scores`` at every position of a chunk (``logits`` ``[n, k, vocab]``) of the
    prompt's next tokens (``tokens`` ``[n, k]``) where a row wants them (``want`` > 0),
    ``[n, k, 1 + 2 * top]``; zeros (and no work) when none does."""
    n, k, vocab = logits.shape
    shape = (n, k, 1 + 2 * top_count(vocab))

    def each(_: Any) -> jax.Array:
        flat = scores(logits.reshape(n * k, vocab), tokens.reshape(n * k))
        return flat.reshape(shape)

    return lax.cond(jnp.any(want > 0), each, lambda _: jnp.zeros(shape, jnp.float32), None)


def maybe_scores(logits: jax.Array, tokens: jax.Array, want: jax.Array) -> jax.Array:
    """``scores`` when a row wants them (``want`` > 0), zeros (and no work) otherwise."""
    shape = (logits.shape[0], 1 + 2 * top_count(logits.shape[-1]))
    return lax.cond(
        jnp.any(want > 0),
        lambda _: scores(logits, tokens),
        lambda _: jnp.zeros(shape, jnp.float32),
        None,
    )


def unpack(row: Any, top: int) -> tuple[float, list[tuple[int, float]]]:
    """A ``scores`` row on the host: (the token's log-probability, the ``top`` most
    likely (id, log-probability), most likely first)."""
    n = (len(row) - 1) // 2
    top = min(top, n)
    return float(row[0]), [(int(row[1 + n + i]), float(row[1 + i])) for i in range(top)]


#: Bits of a row's CTRL column: which of its controls apply (0: none).
PENALTIES = 1  # logit bias, the penalties, min_tokens
GRAMMAR = 2  # a structured output's allowed tokens


def controls(
    logits: jax.Array,
    ctrl: jax.Array,
    source: dict,
    index: jax.Array | None,
    floats: jax.Array,
    position: jax.Array,
    until: jax.Array,
) -> jax.Array:
    """``logits`` ``[n, vocab]`` (float32) with each row's controls (``ctrl``: its
    ``PENALTIES`` and ``GRAMMAR`` bits), read from ``source`` (the state's control
    arrays; rows ``index`` of them, or all). ``PENALTIES``: ``bias`` added at
    ``bias_ids`` (ids out of range: padding), the repetition penalty on the tokens seen
    (``prompted``, or ``counts`` > 0: a positive logit divided by it, a negative one
    multiplied), the frequency penalty times each token's count and the presence
    penalty once per token generated subtracted, and the ``banned`` ids masked while
    ``position < until``. ``GRAMMAR``: the tokens the ``allowed`` bits leave out
    masked. Each costs nothing in a call where no row has it."""
    n, vocab = logits.shape

    def rows(*names: str) -> dict:
        return {k: source[k] if index is None else source[k][index] for k in names}

    def penalties(out: jax.Array) -> jax.Array:
        got = rows("counts", "prompted", "bias_ids", "bias", "banned")
        counts = got["counts"]
        at = jnp.arange(n)[:, None]
        out = out.at[at, got["bias_ids"]].add(got["bias"], mode="drop")
        seen = got["prompted"] | (counts > 0)
        rep = floats[:, REPETITION][:, None]
        out = jnp.where(seen, jnp.where(out > 0, out / rep, out * rep), out)
        out = out - floats[:, FREQUENCY][:, None] * counts
        out = out - floats[:, PRESENCE][:, None] * (counts > 0)
        banned = jnp.zeros((n, vocab), jnp.bool_).at[at, got["banned"]].set(True, mode="drop")
        out = jnp.where(banned & (position < until)[:, None], -jnp.inf, out)
        return jnp.where((ctrl & PENALTIES > 0)[:, None], out, logits)

    def grammar(out: jax.Array) -> jax.Array:
        keep = allowed(rows("allowed")["allowed"], vocab) | (ctrl & GRAMMAR == 0)[:, None]
        return jnp.where(keep, out, -jnp.inf)

    out = lax.cond(jnp.any(ctrl & PENALTIES > 0), penalties, lambda out: out, logits)
    return lax.cond(jnp.any(ctrl & GRAMMAR > 0), grammar, lambda out: out, out)


def allowed(words: jax.Array, vocab: int) -> jax.Array:
    """Masks of one bit per token (``[n, ceil(vocab / 32)]`` int32 words, token ``i``
    bit ``i % 32`` of word ``i // 32``: a structured output's grammar) as ``[n, vocab]``
    booleans."""
    ids = jnp.arange(vocab)
    return ((words[:, ids >> 5] >> (ids & 31)) & 1).astype(jnp.bool_)


#: The state's per-slot control arrays (``pxrt.decoder.programs`` makes them): generated
#: tokens' counts and the prompt's tokens (``[slots, vocab]``), the logit bias (ids and
#: values, ``[slots, MAX_LOGIT_BIAS]``), the ids ``min_tokens`` bans, and the tokens a
#: structured output's grammar allows next (``allowed``: bits, all set without one).
CONTROL_ROWS = ("counts", "prompted", "bias_ids", "bias", "banned", "allowed")
