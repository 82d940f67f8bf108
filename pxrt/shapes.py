"""The symbolic dimensions programs are exported with, their bounds, and what export
says when a model's code cannot be traced with them.

Every dimension that varies (the batch ``b``, an input's named dimension, a decoder's
``seq`` and ``length``) is a ``jax.export`` symbol, so one program serves every bucket.
A named dimension is exported *bounded*: ``seq <= 128`` where 128 is its largest
compiled length. Library code that slices a fixed table (a learned position embedding
of 512 rows: ``table[:seq]``, ``min(512, seq)``) needs the bound, or jax's shape checks
stop with "inconclusive". The bound is the artifact's (``manifest["bounds"]``) and
load refuses lengths beyond it, naming it. ``constraints=`` passes more of jax's
symbolic constraints through (``"seq % 8 == 0"`` is not one; ``"seq <= 4 * k"`` is).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jax import export as jax_export

from .specs import BATCH_DIM, MAX_BUCKET

# The dimensions that count rows (a one-shot batch; a decoder's prompts and slots).
BATCHES = (BATCH_DIM, "slots")


class ExportError(ValueError):
    """A model's code could not be traced with the symbolic shapes pxrt exports; the
    message names the dimensions, their bounds and what would help."""


def bounds_for(
    compiled: Mapping[str, Sequence[int]], given: Mapping[str, int | None] | None
) -> dict[str, int]:
    """Dimension -> its export bound: ``given`` where it names one (None: unbounded),
    else the largest length it is compiled at. A bound under a compiled length is
    refused: that length could never run."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(compiled))
    if unknown:
        raise ValueError(
            f"bounds names {unknown}; the dimensions are {', '.join(compiled) or 'none'}"
        )
    out: dict[str, int] = {}
    for d, lengths in compiled.items():
        bound = given[d] if d in given else max(lengths)
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, int) or not 1 <= bound <= MAX_BUCKET:
            raise ValueError(f"bounds[{d!r}] must be an int from 1 to {MAX_BUCKET}, got {bound!r}")
        if bound < max(lengths):
            raise ValueError(
                f"bounds[{d!r}] is {bound} but {d!r} is compiled at {max(lengths)}: raise the "
                "bound or drop that length"
            )
        out[d] = bound
    return out


def symbols(
    names: Sequence[str], bounds: Mapping[str, int], constraints: Sequence[str] = ()
) -> dict[str, Any]:
    """One jax symbol per name, all in one scope, with ``d <= bound`` for each bound
    among ``names`` and those of the user's ``constraints`` that name only these
    dimensions (a program's constraints may only name its own arguments' dimensions)."""
    mine = [c for c in check_constraints(constraints) if set(_words(c)) <= set(names)]
    every = tuple(f"{d} <= {n}" for d, n in bounds.items() if d in names) + tuple(mine)
    try:
        dims = jax_export.symbolic_shape(", ".join(names), constraints=every)
    except ValueError as exc:
        raise ValueError(
            f"constraints {mine}: {exc} (the dimensions are {', '.join(names)})"
        ) from None
    return dict(zip(names, dims))


def check_constraints(
    constraints: Sequence[str], programs: Sequence[Sequence[str]] = ()
) -> list[str]:
    """The user's constraints as a list of strings; with ``programs`` (each program's
    dimension names), each must name the dimensions of one program only."""
    if isinstance(constraints, str):
        constraints = (constraints,)
    out = list(constraints)
    bad = [c for c in out if not isinstance(c, str) or not c.strip()]
    if bad:
        raise ValueError(f"constraints must be strings such as 'seq <= 512', got {bad!r}")
    for c in out:
        if programs and not any(set(_words(c)) <= set(p) for p in programs):
            raise ValueError(
                f"constraint {c!r} must name the dimensions of one program: "
                + "; ".join(", ".join(p) for p in programs)
            )
    return out


def _words(constraint: str) -> list[str]:
    return re.findall(r"[A-Za-z_][A-Za-z_0-9]*", constraint)


def check_lengths(what: str, dim: str, lengths: Sequence[int], bounds: Mapping[str, int]) -> None:
    """Load's check: ``dim``'s lengths stay within the bound its program was exported
    with."""
    bound = bounds.get(dim)
    over = [n for n in lengths if bound is not None and n > bound]
    if over:
        raise ValueError(
            f"{what}: {dim!r} lengths {over} are over {bound}, the bound its program was "
            f"exported with ({dim} <= {bound}); compile lengths up to {bound}, or export "
            f"again with bounds={{{dim!r}: {max(over)}}}"
        )


def _is_shape_error(exc: BaseException, names: Sequence[str]) -> bool:
    """jax could not decide something about a symbolic dimension: its own error, a
    symbol used as an int, or a shape error that shows a symbol inside a shape."""
    text = str(exc)
    if type(exc).__name__ == "InconclusiveDimensionOperation" or "_DimExpr" in text:
        return True
    return "shape" in text.lower() and any(
        re.search(rf"[\[(,]\s*{re.escape(d)}\s*[,)\]]", text) for d in names
    )


@contextlib.contextmanager
def explained(what: str, dims: Mapping[str, int | None]) -> Iterator[None]:
    """Re-raise a jax shape-polymorphism failure while tracing ``what`` as an
    ``ExportError`` that says which dimensions are symbolic, their bounds, and the two
    ways out (a constraint; concrete shapes). Any other error passes unchanged."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only shape errors are rewritten
        if not _is_shape_error(exc, list(dims)):
            raise
        listed = ", ".join(
            f"{d} (batch)" if d in BATCHES else (f"{d} <= {n}" if n else f"{d} (unbounded)")
            for d, n in dims.items()
        )
        named = next((d for d in dims if d not in BATCHES), "seq")
        raise ExportError(
            f"{what} could not be traced with symbolic shapes: {type(exc).__name__}: {exc}\n"
            f"pxrt exports one program for every bucket, so these dimensions are symbols: "
            f"{listed}. If the code compares a dimension with a size (a position table "
            f"sliced to the sequence length), a bound can decide it: bounds={{{named!r}: 512}} "
            f"or constraints=('{named} <= 512',). If it needs a Python int (len(x), range over a "
            "shape, int(x.shape[0])), export with shapes='concrete': one program per "
            "bucket, traced at its own sizes."
        ) from exc
