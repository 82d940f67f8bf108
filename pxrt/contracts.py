"""The seams between pxrt's parts, as Protocols: what an engine needs of its input and
result handlers (the Cython classes in ``_handlers.pyx`` or their twins in
``_handlers_py.py``), and what a ``BatchQueue`` asks of the serving side that owns it.

Types only: nothing here runs on the request path. ``pxrt.dispatch.Program`` is the
seam between an engine and a bucket's compiled program.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

#: How ``pxrt.load`` lays a model out on its devices (named here, without jax, for the
#: serving options that check them before anything loads).
PLACEMENTS = ("sharded", "replicated", "auto")


class InputHandling(Protocol):
    """Validates requests against a model's inputs and assembles batches."""

    @property
    def dim_names(self) -> tuple[str, ...]: ...

    def prepare(self, request: Any) -> tuple[tuple[np.ndarray, ...], int]:
        """The request's arrays in input order, and its rows; raises on bad input."""
        ...

    def lane_of(self, arrays: tuple[np.ndarray, ...]) -> int:
        """The lane (compiled lengths) prepared ``arrays`` wait in."""
        ...

    def lengths_of(self, arrays: tuple[np.ndarray, ...]) -> tuple[int, ...]:
        """Prepared ``arrays``' length per named dimension."""
        ...

    def assemble(self, arrays: list, starts: list, counts: list, buffers: list) -> int:
        """Copy the pieces' rows into the staging ``buffers``; returns the rows."""
        ...


class ResultHandling(Protocol):
    """Splits per-device output shards back into per-request outputs."""

    def split(
        self,
        outputs: list,
        shard_rows: int,
        starts: list,
        counts: list,
        copy: bool = False,
        lengths: list | None = None,
    ) -> list[dict[str, np.ndarray]]: ...


class QueuePolicy(Protocol):
    """What ``BatchQueue.submit`` asks of the serving side (``serving.engine.batcher.Batcher``):
    when to look for a batch, when to sweep deadlines, and the errors of its outcomes."""

    def kick(self) -> None:
        """``kick_rows`` rows wait: a batch could go."""
        ...

    def arm_sweep(self, deadline: float) -> None:
        """A deadline earlier than ``sweep_at`` arrived."""
        ...

    def expired_error(self, request: Any) -> BaseException:
        """The error for a request whose deadline passed while it waited."""
        ...

    def refused_error(self, rows: int) -> BaseException:
        """The error for a request of ``rows`` rows that does not fit the queue."""
        ...

    def closed_error(self) -> BaseException:
        """The error for a request submitted after the queue closed."""
        ...


__all__ = ["InputHandling", "QueuePolicy", "ResultHandling"]
