"""From prepared requests to per-request outputs: chunk planning, the staging ring,
and running one chunk through assemble -> put -> execute -> fetch -> split.

No asyncio here: ``serving`` drives these pieces from its event loop and worker
threads; ``Model.run_batch`` drives them inline.
"""

from __future__ import annotations

import bisect
import queue
import threading
import time
from collections.abc import Callable, Sequence
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
    bucket: Any,
    input_handler: Any,
    result_handler: Any,
    pieces: list,
    starts: list[int],
    counts: list[int],
    copy: bool,
) -> list[dict[str, np.ndarray]]:
    """Run one batch synchronously in ``bucket`` (its ``program`` and ``ring``); piece
    ``i`` is rows ``starts[i]:starts[i]+counts[i]`` of the prepared array tuple
    ``pieces[i]``. Returns one output dict per piece."""
    ring, program = bucket.ring, bucket.program
    slot = ring.acquire()
    try:
        input_handler.assemble(pieces, starts, counts, slot.buffers)
        outputs = program.run(slot)
    finally:
        ring.release(slot)  # the outputs are fetched: the slot's device buffers are done
    return result_handler.split(outputs, program.out_shard_rows, _offsets(counts), counts, copy)


def join_pieces(parts: list[dict], copy: bool) -> dict[str, np.ndarray]:
    """One request's outputs from the outputs of its pieces (in row order), read-only
    unless ``copy``, like every output pxrt hands out."""
    out = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
    if not copy:
        for arr in out.values():
            arr.flags.writeable = False
    return out


class BatchJob:
    """One batch on its way through the pipeline.

    The submitter fills ``bucket``, the pieces (``pieces[i]`` is the prepared array
    tuple whose rows ``starts[i]:starts[i]+counts[i]`` go in), ``rows`` and ``context``
    (anything it needs back). The pipeline fills ``outputs`` (one dict per piece) or
    ``error``, and the stage clocks (``time.perf_counter``): started, dispatched
    (assembled + put + execution launched), fetched (outputs ready), done (split).
    """

    __slots__ = (
        "bucket",
        "pieces",
        "starts",
        "counts",
        "rows",
        "copy",
        "context",
        "outputs",
        "error",
        "t_start",
        "t_assembled",
        "t_dispatched",
        "t_fetched",
        "t_done",
    )

    def __init__(
        self,
        bucket: Any,
        pieces: list,
        starts: list,
        counts: list,
        rows: int,
        context: Any = None,
        copy: bool = False,
    ) -> None:
        self.bucket = bucket
        self.pieces = pieces
        self.starts = starts
        self.counts = counts
        self.rows = rows
        self.copy = copy
        self.context = context
        self.outputs: list[dict] | None = None
        self.error: BaseException | None = None
        self.t_start = self.t_assembled = self.t_dispatched = self.t_fetched = self.t_done = 0.0


_STOP = object()


class Pipeline:
    """Runs batches through assemble -> put -> execute on a dispatcher thread and
    fetch -> split on a fetcher thread, so one batch executes while the next is being
    assembled and dispatched (two or more in flight; the staging rings bound how many).

    ``on_done(job)`` is called on the fetcher thread once per batch, with
    ``job.outputs`` or ``job.error`` set. A failing batch fails alone.
    """

    def __init__(self, model: Any, on_done: Callable[[BatchJob], None], name: str = "") -> None:
        self.model = model
        self.compile_owner = model  # compiles under the stage functions count for the model
        self._on_done = on_done
        self._input_handler = model.input_handler
        self._result_handler = model.result_handler
        self._to_dispatch: queue.SimpleQueue = queue.SimpleQueue()
        self._to_fetch: queue.SimpleQueue = queue.SimpleQueue()
        label = name or getattr(model, "name", "model")
        self._threads = [
            threading.Thread(
                target=self._dispatch_loop, name=f"pxrt-dispatch-{label}", daemon=True
            ),
            threading.Thread(target=self._fetch_loop, name=f"pxrt-fetch-{label}", daemon=True),
        ]
        self._closed = False
        for t in self._threads:
            t.start()

    def submit(self, job: BatchJob) -> None:
        """Queue a batch; never blocks."""
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        self._to_dispatch.put(job)

    def close(self) -> None:
        """Finish every submitted batch, then stop the threads (blocks until they end)."""
        if not self._closed:
            self._closed = True
            self._to_dispatch.put(_STOP)
        for t in self._threads:
            t.join()

    @_xla.compile_counter.request_path
    def _dispatch_loop(self) -> None:
        clock = time.perf_counter
        assemble = self._input_handler.assemble
        while True:
            job = self._to_dispatch.get()
            if job is _STOP:
                self._to_fetch.put(_STOP)
                return
            job.t_start = clock()
            bucket = job.bucket
            slot = bucket.ring.acquire()
            try:
                assemble(job.pieces, job.starts, job.counts, slot.buffers)
                job.t_assembled = clock()
                handle = bucket.program.dispatch(slot)
            except BaseException as exc:  # noqa: BLE001 - the batch's callers get it
                bucket.ring.release(slot)
                job.error = exc
                self._to_fetch.put((job, None, None))
                continue
            job.t_dispatched = clock()
            self._to_fetch.put((job, slot, handle))

    @_xla.compile_counter.request_path
    def _fetch_loop(self) -> None:
        clock = time.perf_counter
        split = self._result_handler.split
        while True:
            item = self._to_fetch.get()
            if item is _STOP:
                return
            job, slot, handle = item
            if slot is not None:
                program = job.bucket.program
                try:
                    outputs = program.fetch(handle)
                    job.t_fetched = clock()
                    job.outputs = split(
                        outputs, program.out_shard_rows, _offsets(job.counts), job.counts, job.copy
                    )
                except BaseException as exc:  # noqa: BLE001 - the batch's callers get it
                    job.error = exc
                finally:
                    # The outputs are fetched (or failed): the slot's device buffers are done.
                    del handle
                    job.bucket.ring.release(slot)
            job.t_done = clock()
            try:
                self._on_done(job)
            except BaseException:  # noqa: BLE001 - a broken callback must not stop the pipeline
                import traceback

                traceback.print_exc()


def _offsets(counts: list[int]) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out
