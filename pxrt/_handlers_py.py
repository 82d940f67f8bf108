"""Pure-Python twin of ``pxrt._handlers`` (used with PXRT_NO_EXTENSIONS=1).

Same interface and same results; tests run both. Slower: numpy slicing per piece
instead of one GIL-free memcpy loop.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _keys_py as _keys
from ._validate import check_bools, check_lanes, inner_contiguous, validate


class InputHandler:
    """Validates requests against a model's inputs and assembles batches.

    Args:
      model: the model name, used in error messages.
      names, dtypes, shapes: the model's inputs, in order, with per-example shapes.
      max_routes: bound of the signature -> route cache.
    """

    def __init__(
        self,
        model: str,
        names: Sequence[str],
        dtypes: Sequence[np.dtype],
        shapes: Sequence[tuple],
        max_routes: int = 256,
        dim_lengths: Sequence[Sequence[int]] | None = None,
        lane_of: Sequence[int] | None = None,
        pads: Sequence[Any] | None = None,
    ) -> None:
        self.model = model
        self.names = tuple(names)
        self.dtypes = tuple(np.dtype(d) for d in dtypes)
        self.shapes = tuple(tuple(s) for s in shapes)
        self.dim_names = tuple(
            dict.fromkeys(d for s in self.shapes for d in s if isinstance(d, str))
        )
        self.dim_lengths, self._lane_of = check_lanes(self.dim_names, dim_lengths, lane_of)
        self.pads = tuple(
            np.array(0 if pads is None else pads[k], dt).tobytes()
            for k, dt in enumerate(self.dtypes)
        )
        if any(len(p) != dt.itemsize for p, dt in zip(self.pads, self.dtypes)):
            raise ValueError(f"pads must be one scalar per input, got {pads!r}")
        self._pad_values = [np.frombuffer(p, dt)[0] for p, dt in zip(self.pads, self.dtypes)]
        self.row_nbytes = tuple(
            0
            if any(isinstance(d, str) for d in s)
            else int(np.prod(s, dtype=np.int64)) * d.itemsize
            for d, s in zip(self.dtypes, self.shapes)
        )
        # Per named dimension: the (input, axis) its length is read from.
        self._len_src = [
            next(
                (k, axis)
                for k, s in enumerate(self.shapes)
                for axis, d in enumerate(s, 1)
                if d == name
            )
            for name in self.dim_names
        ]
        self.routes = _keys.RouteCache(max_routes)
        self._bools = tuple(k for k, dt in enumerate(self.dtypes) if dt == np.bool_)

    @property
    def dim_max(self) -> dict[str, int]:
        """Named dimension -> the largest length a request may have."""
        return {d: lengths[-1] for d, lengths in zip(self.dim_names, self.dim_lengths)}

    def _validate(self, request: Any) -> tuple[tuple[np.ndarray, ...], int]:
        return validate(self.model, self.names, self.dtypes, self.shapes, request, self.dim_max)

    def lengths_of(self, arrays: tuple) -> tuple[int, ...]:
        """Prepared ``arrays``' length along each named dimension, in order."""
        return tuple(arrays[k].shape[axis] for k, axis in self._len_src)

    def lane_of(self, arrays: tuple) -> int:
        """The lane (compiled lengths) that prepared ``arrays`` run in; 0 without
        named dimensions."""
        if not self.dim_names:
            return 0
        flat = 0
        for name, lengths, length in zip(self.dim_names, self.dim_lengths, self.lengths_of(arrays)):
            i = bisect.bisect_left(lengths, length)
            if i == len(lengths):
                raise ValueError(
                    f"dimension {name!r} is {length}, over the largest compiled length "
                    f"{lengths[-1]}"
                )
            flat = flat * len(lengths) + i
        lane = self._lane_of[flat]
        if lane < 0:
            raise ValueError(
                f"model {self.model!r}: no compiled cell holds lengths "
                f"{dict(zip(self.dim_names, self.lengths_of(arrays)))}"
            )
        return lane

    def clear_routes(self) -> None:
        """Forget every signature seen (the route cache)."""
        self.routes.clear()

    def prepare(self, request: Any) -> tuple[tuple[np.ndarray, ...], int]:
        """Validate one request; returns its arrays in model input order and its rows.
        A bool input must hold only the bytes 0 and 1."""
        arrays, rows = self._prepare_arrays(request)
        if self._bools:
            check_bools(self.model, self.names, self._bools, arrays)
        return arrays, rows

    def _prepare_arrays(self, request: Any) -> tuple[tuple[np.ndarray, ...], int]:
        key = _keys.signature(request)
        perm = self.routes.get(key) if key is not None else None
        if perm is None:
            arrays, rows = self._validate(request)
            if key is not None:
                order = list(request)
                self.routes.put(key, tuple(order.index(n) for n in self.names))
            return arrays, rows
        values = list(request.values())
        arrays = tuple(values[p] for p in perm)
        rows = arrays[0].shape[0]
        for arr in arrays:
            if arr.shape[0] != rows or rows < 1:
                # Same signature, different row counts (or none): the full check words it.
                return self._validate(request)
        if not all(inner_contiguous(a) for a in arrays):
            arrays = tuple(a if inner_contiguous(a) else np.ascontiguousarray(a) for a in arrays)
        return arrays, rows

    def assemble(self, arrays: list, starts: list, counts: list, buffers: list) -> int:
        """Copy rows ``starts[i]:starts[i]+counts[i]`` of each piece ``arrays[i]`` (a
        tuple in input order, from ``prepare``) into consecutive rows of ``buffers``
        (one ``(bucket, ...)`` staging buffer per input), zero the rows after them, and
        return the number of rows written."""
        if not len(arrays) == len(starts) == len(counts):
            raise ValueError("arrays, starts and counts must have the same length")
        if len(buffers) != len(self.names):
            raise ValueError(f"expected {len(self.names)} staging buffers, got {len(buffers)}")
        for i, piece in enumerate(arrays):
            if type(piece) is not tuple or len(piece) != len(self.names):
                raise ValueError(
                    f"piece {i} must be a tuple of {len(self.names)} arrays "
                    f"(InputHandler.prepare's), got {type(piece).__name__}"
                )
        total = sum(counts)
        for j, buf in enumerate(buffers):
            if total > buf.shape[0]:
                raise ValueError(f"{total} rows do not fit a staging buffer of {buf.shape[0]}")
            pad = self._pad_values[j]
            if self.dim_names:
                buf[...] = pad
            offset = 0
            for piece, start, count in zip(arrays, starts, counts):
                src = piece[j]
                if start < 0 or start + count > src.shape[0]:
                    raise ValueError(
                        f"rows {start}:{start + count} out of range for {src.shape[0]} rows"
                    )
                if src.ndim != buf.ndim or any(s > t for s, t in zip(src.shape[1:], buf.shape[1:])):
                    raise ValueError(
                        f"input {self.names[j]!r}: shape {src.shape[1:]} does not fit "
                        f"{buf.shape[1:]}"
                    )
                # Into the corner of its rows: the rest keeps the pad value.
                corner = (slice(offset, offset + count),) + tuple(
                    slice(0, n) for n in src.shape[1:]
                )
                buf[corner] = src[start : start + count]
                offset += count
            if not self.dim_names:
                buf[total:] = pad
        return total


class ResultHandler:
    """Splits per-device output shards back into per-request outputs.

    Args:
      names, dtypes, shapes: the model's outputs, in order, with per-example shapes.
    """

    def __init__(
        self,
        names: Sequence[str],
        dtypes: Sequence[np.dtype],
        shapes: Sequence[tuple],
        dim_names: Sequence[str] = (),
    ) -> None:
        self.names = tuple(names)
        self.dtypes = tuple(np.dtype(d) for d in dtypes)
        self.shapes = tuple(tuple(s) for s in shapes)
        dim_names = tuple(dim_names)
        for shape in self.shapes:
            for d in shape:
                if isinstance(d, str) and d not in dim_names:
                    raise ValueError(
                        f"output dimension {d!r} is not one of the inputs' named "
                        f"dimensions {list(dim_names)}"
                    )
        # Per output: ((axis of the full array, index of its named dimension), ...).
        self._cuts = tuple(
            tuple((axis, dim_names.index(d)) for axis, d in enumerate(s, 1) if isinstance(d, str))
            for s in self.shapes
        )

    def split(
        self,
        outputs: list,
        shard_rows: int,
        starts: list,
        counts: list,
        copy: bool = False,
        lengths: list | None = None,
    ) -> list[dict[str, np.ndarray]]:
        """``outputs[k]`` holds output k's shards in row order, ``shard_rows`` rows each.
        Returns, per piece, a dict name -> rows ``starts[i]:starts[i]+counts[i]``: a view
        of a shard when the piece lies inside one (unless ``copy``), else a new array.
        Outputs with named dimensions are cut to ``lengths[i]`` (the piece's length per
        named dimension) along them."""
        if len(starts) != len(counts):
            raise ValueError("starts and counts must have the same length")
        if shard_rows < 1:
            raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
        if len(outputs) != len(self.names):
            raise ValueError(f"expected {len(self.names)} outputs, got {len(outputs)}")
        for name, shards in zip(self.names, outputs):
            for s, shard in enumerate(shards):
                if shard.ndim < 1 or shard.shape[0] != shard_rows:
                    raise ValueError(
                        f"output {name!r} shard {s} has shape {shard.shape}, "
                        f"expected {shard_rows} rows"
                    )
        if any(self._cuts) and (lengths is None or len(lengths) != len(starts)):
            raise ValueError("outputs with named dimensions need each piece's lengths")
        return split_pieces(
            self.names, self._cuts, outputs, shard_rows, starts, counts, copy, lengths
        )


def split_pieces(
    names: Sequence[str],
    cuts: Sequence[tuple],
    outputs: list,
    shard_rows: int,
    starts: list,
    counts: list,
    copy: bool,
    lengths: list | None,
) -> list[dict[str, np.ndarray]]:
    """``ResultHandler.split``'s work once its arguments are checked: per piece, each
    output's rows (a view of a shard when the piece lies inside one, unless ``copy``;
    else a new, read-only array), cut to the piece's ``lengths`` along each named
    dimension (``cuts[k]``: output k's (axis, dimension index) pairs). The Cython
    handler calls it for outputs with named dimensions."""
    results = []
    for i, (start, count) in enumerate(zip(starts, counts)):
        if start < 0 or count < 1 or start + count > len(outputs[0]) * shard_rows:
            raise ValueError(
                f"rows {start}:{start + count} out of range for {len(outputs[0]) * shard_rows} rows"
            )
        first, offset = divmod(start, shard_rows)
        one_shard = offset + count <= shard_rows
        out = {}
        for name, shards, cut in zip(names, outputs, cuts):
            index = [slice(None)] * shards[0].ndim
            for axis, d in cut:
                assert lengths is not None  # split checked: cut outputs come with lengths
                index[axis] = slice(0, lengths[i][d])
            inner = tuple(index[1:])
            if one_shard:
                arr = shards[first][(slice(offset, offset + count), *inner)]
                out[name] = arr.copy() if copy else arr
            else:
                stop = start + count
                last = (stop - 1) // shard_rows
                parts = [shards[first][(slice(offset, None), *inner)]]
                parts += [shards[s][(slice(None), *inner)] for s in range(first + 1, last)]
                parts.append(shards[last][(slice(0, stop - last * shard_rows), *inner)])
                arr = np.concatenate(parts)
                if not copy:  # outputs are read-only unless the caller asked for copies
                    arr.flags.writeable = False
                out[name] = arr
        results.append(out)
    return results
