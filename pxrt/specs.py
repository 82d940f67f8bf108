"""Tensor specs: what an artifact's inputs and outputs are (a dtype and a per-example
shape whose dimensions are sizes or names), and the checks on them that export, the
manifest and the handlers share."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import ml_dtypes
import numpy as np

# typo (1e9) is refused before anything is allocated for it.
MAX_BUCKET = 1 << 20
BATCH_DIM = "b"  # the batch dimension's symbol in the program; not a name for others

# dtype name -> numpy dtype; names are what manifests and error messages use.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)


def as_dtype(dtype: Any) -> np.dtype:
    """A supported numpy dtype from a name, a numpy/ml_dtypes dtype or a scalar type."""
    try:
        dt = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    except (KeyError, TypeError) as exc:
        raise TypeError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}") from exc
    if dt.name not in DTYPES or dt != DTYPES[dt.name]:
        raise TypeError(f"unsupported dtype {dt}; supported: {', '.join(DTYPES)}")
    return DTYPES[dt.name]


Dim = int | str
_L = TypeVar("_L")  # what TensorSpec.at puts for a named dimension


def is_dim_name(d: Any) -> bool:
    return isinstance(d, str) and d.isidentifier() and d != BATCH_DIM


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One named input or output: its per-example ``shape`` (the leading batch
    dimension is implicit) and its exact ``dtype``.

    A dimension of ``shape`` is a size (an int) or a name (``"seq"``): a length that
    varies from request to request, compiled at the lengths ``dim_buckets`` gives it.
    ``pad`` is what an input's rows are padded with up to the compiled length (and
    what fills a batch's unused rows); it must be exactly representable in ``dtype``.
    """

    shape: tuple[Dim, ...]
    dtype: np.dtype
    pad: bool | int | float = 0

    def __init__(self, shape: Sequence[Dim] | Dim, dtype: Any, pad: bool | int | float = 0):
        if isinstance(shape, (int, str)):
            shape = (shape,)
        dims = tuple(shape)
        for d in dims:
            if isinstance(d, str):
                if not is_dim_name(d):
                    raise ValueError(
                        f"dimension name {d!r} is not usable: names are Python identifiers "
                        f"other than {BATCH_DIM!r} (the batch)"
                    )
            elif not (isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0):
                raise ValueError(
                    f"shape must be a tuple of non-negative ints and dimension names, got {shape!r}"
                )
        dt = as_dtype(dtype)
        object.__setattr__(self, "shape", tuple(d if isinstance(d, str) else int(d) for d in dims))
        object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "pad", check_pad(pad, dt))

    @property
    def dims(self) -> tuple[str, ...]:
        """The named dimensions of the shape, in order."""
        return tuple(d for d in self.shape if isinstance(d, str))

    def at(self, lengths: Mapping[str, _L]) -> tuple[int | _L, ...]:
        """The per-example shape with each named dimension at ``lengths[name]`` (ints,
        or jax's symbolic dimensions at export)."""
        return tuple(lengths[d] if isinstance(d, str) else d for d in self.shape)

    @property
    def nbytes_per_row(self) -> int:
        """Bytes of one example (one row of a batch); only for fixed shapes."""
        if self.dims:
            raise ValueError(f"{self.describe()} has named dimensions: use nbytes_at(lengths)")
        return math.prod(self.at({})) * self.dtype.itemsize

    def nbytes_at(self, lengths: Mapping[str, int]) -> int:
        """Bytes of one example with the named dimensions at ``lengths``."""
        return math.prod(self.at(lengths)) * self.dtype.itemsize

    def describe(self) -> str:
        return f"{self.dtype.name}[{', '.join(['n', *map(str, self.shape)])}]"

    def to_json(self, name: str, *, pad: bool = False) -> dict:
        out: dict[str, Any] = {"name": name, "dtype": self.dtype.name, "shape": list(self.shape)}
        if pad:
            out["pad"] = self.pad
        return out


def check_pad(pad: Any, dtype: np.dtype) -> bool | int | float:
    """``pad`` as a plain JSON-able scalar that ``dtype`` holds exactly."""
    if isinstance(pad, np.generic):
        pad = pad.item()
    if dtype == np.bool_:
        if pad in (0, 1) and isinstance(pad, (bool, int)):
            return bool(pad)
    elif np.issubdtype(dtype, np.integer):
        if isinstance(pad, int) and not isinstance(pad, bool):
            info = np.iinfo(dtype)
            if info.min <= pad <= info.max:
                return pad
    elif isinstance(pad, (int, float)) and not isinstance(pad, bool):
        try:
            value = float(pad)
        except OverflowError:
            value = math.inf
        with np.errstate(over="ignore"):
            if np.isfinite(value) and float(np.array(value, dtype)) == value:
                return value
    raise ValueError(f"pad value {pad!r} is not exactly representable as {dtype.name}")


def check_lengths(name: str, lengths: Any) -> tuple[int, ...]:
    """The lengths to compile named dimension ``name`` at, sorted, checked."""
    try:
        out = tuple(sorted({int(v) for v in lengths}))
        if any(isinstance(v, bool) or int(v) != v for v in lengths):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"dim_buckets[{name!r}] must be positive ints, got {lengths!r}") from None
    if not out or out[0] < 1 or out[-1] > MAX_BUCKET:
        raise ValueError(
            f"dim_buckets[{name!r}] must be non-empty, positive and at most {MAX_BUCKET}, "
            f"got {lengths!r}"
        )
    return out
