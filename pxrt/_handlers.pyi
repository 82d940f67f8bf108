# Types of pxrt/_handlers.pyx (input and result handlers) as Python sees it;
# pxrt/_handlers_py.py is its pure-Python twin with the same API. The C-level API is
# pxrt/_handlers.pxd.
from collections.abc import Sequence
from typing import Any

import numpy as np

from pxrt._keys import RouteCache

class InputHandler:
    @property
    def model(self) -> str: ...
    @property
    def names(self) -> tuple[str, ...]: ...
    @property
    def dtypes(self) -> tuple[np.dtype, ...]: ...
    @property
    def shapes(self) -> tuple[tuple[int | str, ...], ...]: ...
    @property
    def row_nbytes(self) -> tuple[int, ...]: ...
    @property
    def routes(self) -> RouteCache: ...
    @property
    def dim_names(self) -> tuple[str, ...]: ...
    @property
    def dim_lengths(self) -> tuple[tuple[int, ...], ...]: ...
    @property
    def pads(self) -> tuple[bytes, ...]: ...
    def __init__(
        self,
        model: str,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int | str]],
        max_routes: int = 256,
        dim_lengths: Sequence[Sequence[int]] | None = None,
        lane_of: Sequence[int] | None = None,
        pads: Sequence[Any] | None = None,
    ) -> None: ...
    @property
    def dim_max(self) -> dict[str, int]: ...
    def clear_routes(self) -> None: ...
    def prepare(self, request: Any) -> tuple[tuple[np.ndarray, ...], int]: ...
    def lane_of(self, arrays: tuple[np.ndarray, ...]) -> int: ...
    def lengths_of(self, arrays: tuple[np.ndarray, ...]) -> tuple[int, ...]: ...
    def assemble(self, arrays: list, starts: list, counts: list, buffers: list) -> int: ...

class ResultHandler:
    @property
    def names(self) -> tuple[str, ...]: ...
    @property
    def dtypes(self) -> tuple[np.dtype, ...]: ...
    @property
    def shapes(self) -> tuple[tuple[int | str, ...], ...]: ...
    def __init__(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int | str]],
        dim_names: Sequence[str] = (),
    ) -> None: ...
    def split(
        self,
        outputs: list,
        shard_rows: int,
        starts: list,
        counts: list,
        copy: bool = False,
        lengths: list | None = None,
    ) -> list[dict[str, np.ndarray]]: ...
