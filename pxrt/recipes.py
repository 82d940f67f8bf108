"""Helpers that fit model code written for other runtimes to pxrt's decoder contract.

``per_slot``: library decoders (gemma, keras-hub's cached attention) step a batch of
sequences that all sit at one cache index (``end_index``). pxrt's ``decode`` steps
every slot at its own position. Running the library's step for one sequence under
``jax.vmap`` over the slots gives each slot its own index with the library's attention
untouched: the one-index write becomes a write per slot. ``docs/bring-your-own-model.md``
has the recipe, and ``benchmarks/per_slot.py`` measures what it costs against a
hand-written per-row scatter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def per_slot(step: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
    """pxrt's ``decode`` from a step over one sequence.

    ``step(params, cache, tokens, positions) -> (cache, logits)`` sees one slot as a
    batch of one: ``cache`` is the slot's cache with a leading axis of 1 (the layout
    the cache spec gives, ``[1, ...]``), ``tokens`` and ``positions`` are ``int32[1]``
    (``positions[0]`` is the index to write at, the library's ``end_index``), and it
    returns the updated ``[1, ...]`` cache and ``[1, vocab]`` logits. The returned
    ``decode(params, cache, tokens, positions)`` runs it for every slot at once
    (``jax.vmap``), each at its own position. The step must not mix the rows of its
    batch (it has one) and must mask cache positions beyond ``positions[0]``.

    The same makes pxrt's ``extend`` from a step over a chunk of one sequence: there
    ``tokens`` is ``int32[1, k]`` (written from ``positions[0]`` on, each attending to
    the cache before it and to the chunk causally) and the logits ``[1, k, vocab]``.
    """

    def one(params: Any, row: Any, token: Any, position: Any) -> tuple[Any, Any]:
        cache, logits = step(
            params, jax.tree.map(lambda a: a[None], row), token[None], position[None]
        )
        return jax.tree.map(lambda a: a[0], cache), logits[0]

    def decode(params: Any, cache: Any, tokens: Any, positions: Any) -> tuple[Any, Any]:
        return jax.vmap(one, in_axes=(None, 0, 0, 0))(params, cache, tokens, positions)

    decode.__name__ = f"per_slot_{getattr(step, '__name__', 'step')}"
    return decode
