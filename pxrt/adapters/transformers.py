"""Hugging Face Flax causal LMs as pxrt decoders (``transformers`` 4.x, whose Flax
classes are the ones with ``init_cache``: GPT-2, GPT-Neo, GPT-J, OPT, Llama, Mistral...).

- ``export_causal_lm(model, path, ...)``: a ``FlaxPreTrainedModel`` causal LM as a
  decoder. Its cache is its own (``init_cache``: per layer ``cached_key``,
  ``cached_value`` of ``[batch, length, heads, head_dim]``, and one ``cache_index``
  scalar for the whole batch, which pxrt does not keep: it is each slot's position),
  per slot. Prefill runs the model over the padded
  prompts into a cache of the prompt's length; decode and extend run it for one slot at
  a time through ``pxrt.per_slot``, with that slot's ``cache_index`` set to its own
  position (HF's one index per batch becomes one per slot), its attention mask over
  the positions before, and its position ids.
- The weights are ``model.params`` (the module is closed over); the tokenizer, given
  as a ``tokenizers``-backed HF tokenizer object or a ``tokenizer.json`` path, goes into
  the artifact, its BOS as ``start_ids`` where the tokenizer adds one.

Nothing of ``transformers`` is needed where the artifact is served.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

from ..decoder import export_decoder
from ..recipes import per_slot
from ..specs import TensorSpec
from ._cache import per_slot_spec, same_logits

INDEX = "cache_index"


def _strip(tree: Any) -> Any:
    """HF's cache less its ``cache_index`` scalars: what pxrt keeps per slot (every
    leaf with a sequence axis, so that the prefix cache and windows apply)."""
    if isinstance(tree, dict):
        return {k: _strip(v) for k, v in tree.items() if k != INDEX}
    return tree


def _indexed(tree: Any, index: Any) -> Any:
    """pxrt's cache as HF takes it: ``cache_index`` put back as ``index`` beside each
    layer's ``cached_key``."""
    if isinstance(tree, dict):
        out = {k: _indexed(v, index) for k, v in tree.items()}
        if "cached_key" in tree:
            out[INDEX] = index
        return out
    return tree


def cache_spec(model: Any) -> Any:
    """The model's cache for one sequence (``init_cache``'s, without the batch and the
    ``cache_index`` scalars, which pxrt sets per slot) as ``TensorSpec``s, the axis that
    follows the length named ``length``."""
    import jax

    a, b = (jax.eval_shape(lambda n=n: _strip(model.init_cache(1, n))) for n in (8, 16))

    def spec(path: Any, x: Any, y: Any) -> TensorSpec:
        where = f" leaf {jax.tree_util.keystr(path)}"
        return per_slot_spec(type(model).__name__, where, x, y, (8, 16))

    return jax.tree_util.tree_map_with_path(spec, a, b)


def last_logits_head(model: Any) -> Any:
    """``head(params, hidden) -> logits``, the model's language-model head on its final
    hidden states, so that a prefill projects each prompt's last position only (the
    first token needs no other; the vocabulary's projection is half of a small model's
    prefill); None where none is found. The candidates, an ``lm_head`` kernel (and
    bias) or a tied token embedding (an ``embedding`` of ``[vocab, hidden]``), are
    checked against the model's own logits on a 3-token prompt (eager, the real
    weights); the first that gives them to float32 rounding is the head."""
    import jax
    import jax.numpy as jnp

    params = model.params
    vocab = getattr(model.config, "vocab_size", None)
    candidates = []
    lm_head = params.get("lm_head") if isinstance(params, dict) else None
    if isinstance(lm_head, dict) and "kernel" in lm_head:
        candidates.append(lambda p, h: h @ p["lm_head"]["kernel"] + p["lm_head"].get("bias", 0.0))
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [getattr(k, "key", None) for k in path]
        if keys[-1] == "embedding" and leaf.ndim == 2 and leaf.shape[0] == vocab:

            def tied(p: Any, h: Any, keys: list = keys) -> Any:
                for key in keys:
                    p = p[key]
                return h @ p.T

            candidates.append(tied)
    try:
        out = model(jnp.asarray([[1, 2, 3]], jnp.int32), params=params, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -1]
    except Exception:  # noqa: BLE001 - no hidden states: every position's logits
        return None
    return next((h for h in candidates if same_logits(h(params, hidden), out.logits[:, -1])), None)


def _tokenizer_file(tokenizer: Any, directory: str) -> tuple[str | os.PathLike | None, list[int]]:
    """A tokenizer as the file export_decoder takes, and its start ids: a path as it
    is; an HF fast tokenizer's ``backend_tokenizer`` as ``tokenizer.json``, its BOS
    where it adds one (``add_bos_token``)."""
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer, []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer: pass "
            "its tokenizer.json path, or load it with use_fast=True"
        )
    path = os.path.join(directory, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(backend.to_str())
    bos = getattr(tokenizer, "bos_token_id", None)
    start = [int(bos)] if getattr(tokenizer, "add_bos_token", False) and bos is not None else []
    return path, start


def export_causal_lm(
    model: Any,
    path: str | os.PathLike,
    *,
    max_length: int = 512,
    slots: int = 8,
    prefill_lengths: Sequence[int] = (32, 128),
    prefill_batches: Sequence[int] = (1, 4),
    eos_id: int | None = None,
    tokenizer: Any = None,
    **options: Any,
) -> str:
    """Export a Hugging Face Flax causal LM as a pxrt decoder (see the module
    docstring); ``options`` as for ``pxrt.export_decoder``. ``max_length`` is at most
    the model's ``max_position_embeddings`` (its causal mask's size). ``eos_id``
    defaults to the config's. Returns the artifact path."""
    import jax
    import jax.numpy as jnp

    limit = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", None
    )
    if limit is not None and max_length > limit:
        raise ValueError(
            f"max_length {max_length} is over {type(model).__name__}'s "
            f"max_position_embeddings ({limit}): its causal mask has no more positions"
        )
    spec = cache_spec(model)
    head = last_logits_head(model)

    def prefill(params: Any, tokens: Any, lengths: Any) -> Any:
        b, n = tokens.shape
        mask = (jnp.arange(n)[None, :] < lengths[:, None]).astype(jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
        out = model(
            tokens, attention_mask=mask, position_ids=positions, params=params,
            past_key_values=model.init_cache(b, n), output_hidden_states=head is not None,
        )  # fmt: skip
        at = (lengths - 1)[:, None, None]
        if head is None:
            last = jnp.take_along_axis(out.logits, at, axis=1)[:, 0]
        else:  # (the logits of every position unused: XLA leaves them out)
            last = head(params, jnp.take_along_axis(out.hidden_states[-1], at, axis=1)[:, 0])
        return _strip(out.past_key_values), last.astype(jnp.float32)

    def one_chunk(params: Any, cache: Any, tokens: Any, positions: Any) -> Any:
        k = tokens.shape[-1]  # (tokens [1, k]: per_slot's row of one sequence)
        start = positions[0]
        length = jax.tree.leaves(cache)[0].shape[1]
        mask = (jnp.arange(length)[None, :] < start + k).astype(jnp.int32)
        ids = (start + jnp.arange(k, dtype=jnp.int32))[None]
        out = model(
            tokens, attention_mask=mask, position_ids=ids, params=params,
            past_key_values=_indexed(cache, start.astype(jnp.int32)),
        )  # fmt: skip
        return _strip(out.past_key_values), out.logits.astype(jnp.float32)

    def one_token(params: Any, cache: Any, tokens: Any, positions: Any) -> Any:
        new, logits = one_chunk(params, cache, tokens[:, None], positions)
        return new, logits[:, 0]

    if eos_id is None:
        eos_id = getattr(model.config, "eos_token_id", None)
        eos_id = eos_id[0] if isinstance(eos_id, (list, tuple)) else eos_id
    options.setdefault("chunk_lengths", sorted({min(prefill_lengths), max(prefill_lengths)}))
    with tempfile.TemporaryDirectory() as tmp:
        file, start = _tokenizer_file(tokenizer, tmp)
        if start:
            options.setdefault("start_ids", start)
        return export_decoder(
            prefill, per_slot(one_token), model.params, path, cache=spec,
            extend=per_slot(one_chunk), max_length=max_length, slots=slots,
            prefill_lengths=prefill_lengths, prefill_batches=prefill_batches, eos_id=eos_id,
            tokenizer=file, **options,
        )  # fmt: skip
