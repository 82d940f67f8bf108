"""Pure-Python twin of ``serving.kserve._tensors`` (used with PXRT_NO_EXTENSIONS=1): the same
strict decoding of JSON tensor data, element by element in Python."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

KIND_BOOL, KIND_INT, KIND_UINT, KIND_FLOAT = 0, 1, 2, 3
# The kinds, for Python callers (the same numbers as the Cython module's).
BOOL, INT, UINT, FLOAT = KIND_BOOL, KIND_INT, KIND_UINT, KIND_FLOAT
_STORAGE = {KIND_BOOL: np.uint8, KIND_INT: np.int64, KIND_UINT: np.uint64, KIND_FLOAT: np.float64}
_WHAT = {
    KIND_BOOL: "true or false",
    KIND_INT: "an integer",
    KIND_UINT: "an integer",
    KIND_FLOAT: "a number",
}
_RANGE = {KIND_INT: (-(2**63), 2**63 - 1), KIND_UINT: (0, 2**64 - 1)}


class TensorDataError(ValueError):
    """JSON tensor data that does not match its datatype or shape."""


def _describe(item: Any) -> str:
    if item is True or item is False:
        return "true" if item else "false"
    if item is None:
        return "null"
    text = repr(item)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(item: Any, at: int, kind: int, why: str) -> None:
    raise TensorDataError(f"element {at} is {_describe(item)}: {why or 'expected ' + _WHAT[kind]}")


def _value(item: Any, at: int, kind: int, low: int, high: int, fmax: float) -> Any:
    if kind == KIND_FLOAT:
        if type(item) is float:
            value = item
        elif type(item) is int:
            try:
                value = float(item)
            except OverflowError:
                value = math.inf
        else:
            _bad(item, at, kind, "")
        if not -fmax < value < fmax:
            _bad(item, at, kind, "out of range")
        return value
    if kind == KIND_BOOL:
        if item is True or item is False:
            return int(item)
        _bad(item, at, kind, "")
    if type(item) is not int:  # a bool or a float is not an integer
        _bad(item, at, kind, "")
    lowest, highest = _RANGE[kind]
    if not (lowest <= item <= highest and low <= item <= high):
        _bad(item, at, kind, "out of range")
    return item


def _fill(data: Any, dims: list[int], depth: int, kind: int, out: list, bounds: tuple) -> None:
    at = len(out)
    if type(data) is not list:
        raise TensorDataError(
            f"expected a list of {dims[depth]} at nesting level {depth + 1} (before element "
            f"{at}), got {_describe(data)}"
        )
    if len(data) != dims[depth]:
        raise TensorDataError(
            f"a list of {len(data)} at nesting level {depth + 1} (before element {at}) where "
            f"the shape needs {dims[depth]}"
        )
    if depth < len(dims) - 1:
        for item in data:
            _fill(item, dims, depth + 1, kind, out, bounds)
        return
    for item in data:
        out.append(_value(item, len(out), kind, *bounds))


def decode(
    data: Any, shape: tuple, kind: int, low: int = 0, high: int = 0, fmax: float = math.inf
) -> np.ndarray:
    """``data`` (flat, or nested exactly as ``shape``) as a flat array of ``kind``'s
    storage dtype, every value in range (integers ``low..high``, floats below ``fmax``
    in magnitude); raises TensorDataError naming the first offending element."""
    n = 1
    for d in shape:
        n *= d
    if type(data) is not list:
        raise TensorDataError(f"'data' must be a list, got {_describe(data)}")
    nested = len(shape) > 1 and len(data) > 0 and type(data[0]) is list
    if not nested and len(data) != n:
        raise TensorDataError(f"{len(data)} values where shape {list(shape)} needs {n}")
    values: list = []
    _fill(data, list(shape) if nested else [n], 0, kind, values, (low, high, fmax))
    return np.array(values, _STORAGE[kind]) if values else np.empty(0, _STORAGE[kind])
