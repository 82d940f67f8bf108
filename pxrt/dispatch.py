"""From prepared requests to per-request outputs: chunk planning, the staging ring,
and running one chunk through assemble -> put -> execute -> fetch -> split.

No asyncio here: ``serving`` drives these pieces from its event loop and worker
threads; ``Model.run_batch`` drives them inline.
"""

from __future__ import annotations

import bisect
import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _xla


class Chunk:
    """Rows for one execution: piece ``i`` is rows ``starts[i]:starts[i]+counts[i]`` of
    request ``requests[i]``, laid one after another from row 0 of the batch."""

    __slots__ = ("requests", "starts", "counts", "rows")

    def __init__(self) -> None:
        self.requests: list[int] = []
        self.starts: list[int] = []
        self.counts: list[int] = []
        self.rows = 0

    def offsets(self) -> list[int]:
        """Where each piece starts in the batch."""
        out, at = [], 0
        for c in self.counts:
            out.append(at)
            at += c
        return out


def plan_chunks(rows: Sequence[int], max_rows: int) -> list[Chunk]:
    """Pack requests of ``rows[i]`` rows, in order, into chunks of at most ``max_rows``
    rows. A request larger than the room left is split across chunks; nothing is
    ever reordered, so each request's pieces come in row order."""
    chunks = [Chunk()]
    for req, n in enumerate(rows):
        start = 0
        while n > 0:
            chunk = chunks[-1]
            if chunk.rows == max_rows:
                chunk = Chunk()
                chunks.append(chunk)
            take = min(n, max_rows - chunk.rows)
            chunk.requests.append(req)
            chunk.starts.append(start)
            chunk.counts.append(take)
            chunk.rows += take
            start += take
            n -= take
    return [c for c in chunks if c.rows]


def smallest_bucket(buckets: Sequence[int], rows: int) -> int:
    """The smallest of the sorted ``buckets`` that holds ``rows`` rows."""
    i = bisect.bisect_left(buckets, rows)
    if i == len(buckets):
        raise ValueError(f"{rows} rows exceed the largest compiled bucket {buckets[-1]}")
    return buckets[i]


class StagingRing:
    """Reusable staging slots for one program (bucket).

    A slot is handed out by ``acquire`` and comes back by ``release`` once the batch
    that used it no longer needs it (with zero-copy puts: once its outputs were
    fetched, since the device buffer may alias it). Slots are made on demand, up to
    ``depth``; past that, ``acquire`` waits for a release.
    """

    def __init__(
        self,
        dtypes: Sequence[np.dtype],
        shapes: Sequence[tuple[int, ...]],
        bucket: int,
        row_slices: Sequence[slice],
        depth: int = 3,
    ) -> None:
        if depth < 1:
            raise ValueError(f"staging depth must be >= 1, got {depth}")
        self.dtypes = list(dtypes)
        self.shapes = [tuple(s) for s in shapes]
        self.bucket = bucket
        self.row_slices = list(row_slices)
        self.depth = depth
        # SimpleQueue is C-level: acquire/release cost well under a microsecond.
        self._free: queue.SimpleQueue[_xla.StagingSlot] = queue.SimpleQueue()
        self._made = 0
        self._lock = threading.Lock()

    def acquire(self) -> _xla.StagingSlot:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            make = self._made < self.depth
            if make:
                self._made += 1
        if not make:
            return self._free.get()
        buffers = [
            _xla.aligned_empty((self.bucket,) + s, d) for d, s in zip(self.dtypes, self.shapes)
        ]
        return _xla.StagingSlot(buffers, self.row_slices)

    def release(self, slot: _xla.StagingSlot) -> None:
        self._free.put(slot)

    @property
    def slots_made(self) -> int:
        return self._made

    @property
    def slots_free(self) -> int:
        return self._free.qsize()


def run_chunk(
    program: Any,
    ring: StagingRing,
    input_handler: Any,
    result_handler: Any,
    pieces: list,
    chunk: Chunk,
    copy: bool,
) -> list[dict[str, np.ndarray]]:
    """Run one chunk synchronously; returns one output dict per piece.

    ``pieces[i]`` is the prepared array tuple of the chunk's piece ``i``.
    """
    slot = ring.acquire()
    try:
        input_handler.assemble(pieces, chunk.starts, chunk.counts, slot.buffers)
        outputs = program.run(slot)
    finally:
        ring.release(slot)
    return result_handler.split(
        outputs, program.out_shard_rows, chunk.offsets(), chunk.counts, copy
    )
