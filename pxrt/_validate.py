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
    model: str,
    names: tuple,
    dtypes: tuple,
    shapes: tuple,
    request: Any,
    dim_max: dict[str, int] | None = None,
) -> tuple[tuple[np.ndarray, ...], int]:
    """Check ``request`` against the model's inputs exactly; no casts, ever.

    A shape may name dimensions (strings): their length is free from 1 to
    ``dim_max[name]``, and the same in every input that names them.

    Returns the arrays in the model's input order (C-contiguous rows, copied only when
    a row was not one block) and the number of rows. Raises TypeError for a wrong type
    or dtype and ValueError for wrong names, shapes, lengths or row counts, each naming
    the input (and dimension), what was expected and what came.
    """
    dim_max = dim_max or {}
    lengths: dict[str, tuple[str, int]] = {}  # dimension -> (first input naming it, length)
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
        if value.ndim != len(shape) + 1 or any(
            got != want for got, want in zip(value.shape[1:], shape) if not isinstance(want, str)
        ):
            raise ValueError(
                f"{where}input {name!r}: expected shape {describe(dtype, shape)} "
                f"(a leading batch dimension, then {shape}), got {value.shape}"
            )
        for axis, (got, want) in enumerate(zip(value.shape[1:], shape), 1):
            if not isinstance(want, str):
                continue
            top = dim_max.get(want)
            if got < 1 or (top is not None and got > top):
                raise ValueError(
                    f"{where}input {name!r}: dimension {want!r} (axis {axis}) is {got}; the "
                    f"model takes lengths 1 to {top}"
                    + (" (longer inputs are never truncated)" if got > 1 else "")
                )
            if want in lengths and lengths[want][1] != got:
                first_name, first_len = lengths[want]
                raise ValueError(
                    f"{where}inputs disagree on dimension {want!r}: {first_name!r} has "
                    f"{first_len}, {name!r} has {got}"
                )
            lengths.setdefault(want, (name, got))
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
    assert rows is not None  # a model has at least one input (the manifest's check)
    return tuple(arrays), rows


def bad_bool_error(model: str, name: str, arr: np.ndarray) -> ValueError:
    """The error for a bool input holding a byte other than 0 or 1 (numpy lets such
    bytes in through ``np.frombuffer(data, bool)`` or ``.view(bool)``; XLA gives them
    no meaning)."""
    raw = arr.view(np.uint8)
    index = tuple(int(i) for i in np.argwhere(raw > 1)[0])
    where = f"model {model!r}: " if model else ""
    return ValueError(
        f"{where}input {name!r}: a bool must be the byte 0 or 1, got {int(raw[index])} "
        f"at index {index}"
    )


def check_bools(model: str, names: tuple, bools: tuple, arrays: tuple) -> None:
    """Raise ``bad_bool_error`` for the first of the inputs at positions ``bools``
    holding a byte other than 0 or 1."""
    for k in bools:
        if arrays[k].size and arrays[k].view(np.uint8).max() > 1:
            raise bad_bool_error(model, names[k], arrays[k])


def check_lanes(
    dim_names: tuple, dim_lengths: Any, lane_of: Any
) -> tuple[tuple[tuple[int, ...], ...], list[int]]:
    """(per named dimension: its sorted compiled lengths, the flat lane table), checked.

    ``lane_of`` maps the product of per-dimension length indices (row-major) to the
    lane that runs such requests (-1: none holds them)."""
    if not dim_names:
        return (), [0]
    if dim_lengths is None or lane_of is None or len(dim_lengths) != len(dim_names):
        raise ValueError(
            f"inputs with named dimensions {list(dim_names)} need their compiled lengths "
            "(dim_lengths) and lane table (lane_of)"
        )
    lengths = tuple(tuple(sorted(int(v) for v in ls)) for ls in dim_lengths)
    size = 1
    for ls in lengths:
        if not ls or ls[0] < 1:
            raise ValueError(f"every named dimension needs positive lengths, got {lengths}")
        size *= len(ls)
    if len(lane_of) != size:
        raise ValueError(f"lane_of has {len(lane_of)} entries, expected {size}")
    return lengths, [int(v) for v in lane_of]
