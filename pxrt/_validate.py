"""Full validation of one request: the slow path behind the signature-key route cache.

Shared by the Cython and the pure-Python handlers, so both raise the same errors with
the same messages. It runs once per new request signature, and for every request that
fails (a failing request is never cached).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def describe(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    dims = ", ".join(["n", *map(str, shape)])
    return f"{dtype.name}[{dims}]"


def signature_text(names: tuple, dtypes: tuple, shapes: tuple) -> str:
    return ", ".join(f"{n}: {describe(d, s)}" for n, d, s in zip(names, dtypes, shapes))


def inner_contiguous(arr: np.ndarray) -> bool:
    """Whether each row (one example) is one contiguous C-order block of memory."""
    if arr.flags.c_contiguous:
        return True
    expected = arr.itemsize
    for dim, stride in zip(reversed(arr.shape[1:]), reversed(arr.strides[1:])):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def validate(
    model: str, names: tuple, dtypes: tuple, shapes: tuple, request: Any
) -> tuple[tuple[np.ndarray, ...], int]:
    """Check ``request`` against the model's inputs exactly; no casts, ever.

    Returns the arrays in the model's input order (C-contiguous rows, copied only when
    a row was not one block) and the number of rows. Raises TypeError for a wrong type
    or dtype and ValueError for wrong names, shapes or row counts, each naming the
    input, what was expected and what came.
    """
    where = f"model {model!r}: " if model else ""
    expected = signature_text(names, dtypes, shapes)
    if not isinstance(request, Mapping):
        raise TypeError(
            f"{where}a request must be a mapping of input name -> array "
            f"({expected}), got {type(request).__name__}"
        )
    missing = [n for n in names if n not in request]
    extra = [k for k in request if k not in names]
    if missing or extra:
        parts = []
        if missing:
            parts.append(
                "missing input"
                + ("s " if len(missing) > 1 else " ")
                + ", ".join(map(repr, missing))
            )
        if extra:
            parts.append(
                "unexpected input" + ("s " if len(extra) > 1 else " ") + ", ".join(map(repr, extra))
            )
        raise ValueError(f"{where}{'; '.join(parts)}; the model takes {expected}")
    arrays = []
    rows = None
    first = None
    for name, dtype, shape in zip(names, dtypes, shapes):
        value = request[name]
        if isinstance(value, np.ma.MaskedArray):
            raise TypeError(f"{where}input {name!r}: expected a numpy array, got a masked array")
        if type(value) is not np.ndarray:
            if not (
                isinstance(value, (np.ndarray, np.generic, list, tuple))
                or hasattr(value, "__array__")
            ):
                raise TypeError(
                    f"{where}input {name!r}: expected an array of "
                    f"{describe(dtype, shape)}, got {type(value).__name__}"
                )
            value = np.asarray(value)
            if type(value) is not np.ndarray:
                value = value.view(np.ndarray)
        if value.dtype != dtype:
            raise TypeError(
                f"{where}input {name!r}: expected dtype {dtype.name}, got "
                f"{value.dtype} (pxrt never casts; convert it with "
                f".astype({dtype.name!r}) if that is what you mean)"
            )
        if value.ndim != len(shape) + 1 or value.shape[1:] != shape:
            raise ValueError(
                f"{where}input {name!r}: expected shape {describe(dtype, shape)} "
                f"(a leading batch dimension, then {shape}), got {value.shape}"
            )
        n = value.shape[0]
        if n < 1:
            raise ValueError(f"{where}input {name!r} has 0 rows; a request needs at least 1")
        if rows is None:
            rows, first = n, name
        elif n != rows:
            raise ValueError(
                f"{where}inputs disagree on the number of rows: {first!r} has "
                f"{rows}, {name!r} has {n}"
            )
        if not inner_contiguous(value):
            value = np.ascontiguousarray(value)
        arrays.append(value)
    return tuple(arrays), rows
