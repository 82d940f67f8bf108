"""What the adapters share: a library's cache for one sequence, traced at two lengths,
as pxrt's per-slot ``TensorSpec``s; the check that a model's head, applied to its last
hidden state, gives its own logits."""

from __future__ import annotations

from typing import Any

from ..specs import TensorSpec


def per_slot_spec(owner: str, where: str, x: Any, y: Any, lengths: tuple[int, int]) -> TensorSpec:
    """One cache leaf, ``x`` at ``lengths[0]`` positions and ``y`` at ``lengths[1]``
    (each with a batch of 1), as a per-slot spec: the batch dropped, the one axis that
    follows the length named ``length``; else a ValueError naming ``owner``'s ``where``."""
    axes = [i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n]
    if len(axes) != 1 or x.shape[0] != 1:
        raise ValueError(
            f"{owner}'s cache{where} has shape {tuple(x.shape)} for {lengths[0]} positions "
            f"and {tuple(y.shape)} for {lengths[1]}: expected a batch of 1 and one axis that "
            "follows the length"
        )
    shape: list[int | str] = list(x.shape[1:])
    shape[axes[0] - 1] = "length"
    return TensorSpec(tuple(shape), str(x.dtype))


def same_logits(got: Any, want: Any) -> bool:
    """Whether ``got`` (a head applied to the last position's hidden state) is the
    model's own last-position logits ``want``, to float32 rounding."""
    import numpy as np

    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.max(np.abs(want))) or 1.0
    return got.shape == want.shape and np.allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
