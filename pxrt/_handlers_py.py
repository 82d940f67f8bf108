"""Pure-Python twin of ``pxrt._handlers`` (used with PXRT_NO_EXTENSIONS=1).

Same interface and same results; tests run both. Slower: numpy slicing per piece
instead of one GIL-free memcpy loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _keys_py as _keys
from ._validate import inner_contiguous, validate


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
        shapes: Sequence[tuple[int, ...]],
        max_routes: int = 256,
    ) -> None:
        self.model = model
        self.names = tuple(names)
        self.dtypes = tuple(np.dtype(d) for d in dtypes)
        self.shapes = tuple(tuple(s) for s in shapes)
        self.row_nbytes = tuple(
            int(np.prod(s, dtype=np.int64)) * d.itemsize for d, s in zip(self.dtypes, self.shapes)
        )
        self.routes = _keys.RouteCache(max_routes)

    def clear_routes(self) -> None:
        """Forget every signature seen (the route cache)."""
        self.routes.clear()

    def prepare(self, request: Any) -> tuple[tuple[np.ndarray, ...], int]:
        """Validate one request; returns its arrays in model input order and its rows."""
        key = _keys.signature(request)
        perm = self.routes.get(key) if key is not None else None
        if perm is None:
            arrays, rows = validate(self.model, self.names, self.dtypes, self.shapes, request)
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
                return validate(self.model, self.names, self.dtypes, self.shapes, request)
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
            offset = 0
            for piece, start, count in zip(arrays, starts, counts):
                src = piece[j]
                if start < 0 or start + count > src.shape[0]:
                    raise ValueError(
                        f"rows {start}:{start + count} out of range for {src.shape[0]} rows"
                    )
                buf[offset : offset + count] = src[start : start + count]
                offset += count
            buf[total:] = 0
        return total


class ResultHandler:
    """Splits per-device output shards back into per-request outputs.

    Args:
      names, dtypes, shapes: the model's outputs, in order, with per-example shapes.
    """

    def __init__(
        self, names: Sequence[str], dtypes: Sequence[np.dtype], shapes: Sequence[tuple[int, ...]]
    ) -> None:
        self.names = tuple(names)
        self.dtypes = tuple(np.dtype(d) for d in dtypes)
        self.shapes = tuple(tuple(s) for s in shapes)

    def split(
        self, outputs: list, shard_rows: int, starts: list, counts: list, copy: bool = False
    ) -> list[dict[str, np.ndarray]]:
        """``outputs[k]`` holds output k's shards in row order, ``shard_rows`` rows each.
        Returns, per piece, a dict name -> rows ``starts[i]:starts[i]+counts[i]``: a view
        of a shard when the piece lies inside one (unless ``copy``), else a new array."""
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
        results = []
        for start, count in zip(starts, counts):
            if start < 0 or count < 1 or start + count > len(outputs[0]) * shard_rows:
                raise ValueError(
                    f"rows {start}:{start + count} out of range for "
                    f"{len(outputs[0]) * shard_rows} rows"
                )
            first, offset = divmod(start, shard_rows)
            one_shard = offset + count <= shard_rows
            out = {}
            for name, shards in zip(self.names, outputs):
                if one_shard:
                    arr = shards[first][offset : offset + count]
                    out[name] = arr.copy() if copy else arr
                else:
                    stop = start + count
                    last = (stop - 1) // shard_rows
                    parts = [shards[first][offset:]]
                    parts += [shards[i] for i in range(first + 1, last)]
                    parts.append(shards[last][: stop - last * shard_rows])
                    arr = np.concatenate(parts)
                    if not copy:  # outputs are read-only unless the caller asked for copies
                        arr.flags.writeable = False
                    out[name] = arr
            results.append(out)
        return results
