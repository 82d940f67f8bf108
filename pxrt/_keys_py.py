"""Pure-Python twin of ``pxrt._keys`` (used with PXRT_NO_EXTENSIONS=1)."""

from __future__ import annotations

from typing import Any

import numpy as np

_ndarray = np.ndarray


def signature(request: Any) -> tuple | None:
    """The fast-path cache key of a request: a flat tuple of, per input in the
    request's order, ``name, dtype.num, dtype.isnative, ndim, *shape[1:]``.

    None when the request is not a plain dict of plain ndarrays (such requests
    always take the full validation path).
    """
    if type(request) is not dict:
        return None
    key: list = []
    for name, arr in request.items():
        if type(arr) is not _ndarray:
            return None
        dt = arr.dtype
        key += (name, dt.num, dt.isnative, arr.ndim)
        key += arr.shape[1:]
    return tuple(key)


class RouteCache:
    """A bounded signature -> route map. When full, the oldest entry goes first."""

    def __init__(self, maxsize: int = 256) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._entries: dict = {}

    def get(self, key: Any) -> Any:
        return self._entries.get(key)

    def put(self, key: Any, route: Any) -> None:
        entries = self._entries
        if key not in entries and len(entries) >= self.maxsize:
            del entries[next(iter(entries))]
        entries[key] = route

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries
