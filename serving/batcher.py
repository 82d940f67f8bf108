"""Dynamic batching of one model's requests on the event loop.

A ``Batcher`` queues validated requests and closes a batch when ``max_batch_size`` rows
are waiting or the oldest request has waited ``max_delay_us`` (loop clock, monotonic).
The batch runs in the smallest compiled bucket that holds it, on the model's
``pxrt.dispatch.Pipeline``; while it executes, the next batch keeps forming. Results
come back with one thread-safe call per batch.

Queue policy: a full queue rejects at once (``Overloaded``, with a retry-after
estimate); a request whose deadline passes while queued is answered
``DeadlineExceeded`` and never executed; a caller that cancels before its request is
dispatched removes it. A request larger than the room in a batch is split across
batches and its outputs joined back.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import numpy as np

from pxrt import dispatch

from .errors import DeadlineExceeded, ExecutionFailed, Overloaded, ServerClosed
from .metrics import Metrics

# Measurements use perf_counter: uvloop's loop.time() moves in whole milliseconds.
_clock = time.perf_counter

# Futures resolved per loop callback when a batch's results come back.
DELIVER_SLICE = 32


class Pending:
    """One accepted request, from submit until its future is resolved."""

    __slots__ = (
        "arrays",
        "rows",
        "future",
        "t_enqueue",
        "timer",
        "next_row",
        "parts",
        "rows_done",
    )

    def __init__(self, arrays: tuple, rows: int, future: asyncio.Future, t_enqueue: float):
        self.arrays = arrays
        self.rows = rows
        self.future = future
        self.t_enqueue = t_enqueue
        self.timer: asyncio.TimerHandle | None = None
        self.next_row = 0  # rows before this one are dispatched
        self.parts: list[tuple[int, dict]] | None = None  # only for requests split across batches
        self.rows_done = 0


class Batcher:
    """Batches one model's requests. Create and use it on the event loop's thread."""

    def __init__(
        self,
        name: str,
        model: Any,
        metrics: Metrics,
        *,
        max_batch_size: int | None = None,
        max_delay_us: float = 2000.0,
        max_queue: int = 4096,
        max_inflight: int = 2,
        copy: bool = False,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_us < 0 or max_queue < 1 or max_inflight < 1:
            raise ValueError("max_delay_us must be >= 0, max_queue and max_inflight >= 1")
        self.name = name
        self.model = model
        self.max_batch_size = min(max_batch_size or model.max_batch, model.max_batch)
        self.max_delay = max_delay_us * 1e-6
        self.max_queue = max_queue
        self.max_inflight = max_inflight
        self.copy = copy
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[Pending] = collections.deque()
        self.queued_rows = 0
        self.inflight = 0
        self._closing = False
        self._waiter: asyncio.Future | None = None
        self._buckets = model.buckets

        self._metrics = metrics.add_model(
            name, lambda: self.queued_rows, lambda: model.compiles_after_load
        )
        self._counts = self._metrics.requests

        self.row_seconds = _measure_row_seconds(model)
        self.pipeline = dispatch.Pipeline(model, self._on_done_threadsafe, name)
        self._task = self._loop.create_task(self._form_batches(), name=f"pxrt-batcher-{name}")

    # ------------------------------------------------------------------ submit

    def submit(self, arrays: tuple, rows: int, timeout_s: float | None) -> Pending:
        """Queue a prepared request (``model.input_handler.prepare``'s result)."""
        if self._closing:
            raise ServerClosed(f"model {self.name!r} is shutting down; not accepting requests")
        if self.queued_rows + rows > self.max_queue:
            self._counts["rejected"] += 1
            wait = max(self.queued_rows * self.row_seconds, 1e-3)
            raise Overloaded(
                f"model {self.name!r} is overloaded: {self.queued_rows} rows queued, "
                f"max_queue is {self.max_queue}; retry after {wait:.3f} s",
                retry_after_s=wait,
            )
        loop = self._loop
        pending = Pending(arrays, rows, loop.create_future(), _clock())
        if timeout_s is not None:
            pending.timer = loop.call_later(timeout_s, self._expire, pending, timeout_s)
        was_empty = not self._queue
        self._queue.append(pending)
        self.queued_rows += rows
        if was_empty or self.queued_rows >= self.max_batch_size:
            self._wake()
        return pending

    def cancel(self, pending: Pending) -> None:
        """The caller gave up: drop what of the request was not dispatched yet."""
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None
        if not pending.future.done():
            pending.future.cancel()
        self._counts["cancelled"] += 1
        self._forget(pending)  # rows already dispatched still run; their results are dropped

    def _expire(self, pending: Pending, timeout_s: float) -> None:
        pending.timer = None
        if pending.next_row or pending.future.done():
            return  # already (partly) dispatched: it runs to the end
        self._counts["expired"] += 1
        pending.future.set_exception(
            DeadlineExceeded(
                f"model {self.name!r}: the request's deadline ({timeout_s * 1e3:.1f} ms) "
                "passed while it was queued; it was not executed"
            )
        )
        self._forget(pending)

    def _forget(self, pending: Pending) -> None:
        # Still in the deque: _dispatch_batch skips it; only its rows leave the count now.
        self.queued_rows -= pending.rows - pending.next_row
        pending.next_row = pending.rows

    # ------------------------------------------------------------------ forming

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _sleep(self, until: float | None) -> None:
        waiter = self._waiter = self._loop.create_future()
        handle = None
        if until is not None:
            handle = self._loop.call_at(until, _set_result, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()

    async def _form_batches(self) -> None:
        queue = self._queue
        loop = self._loop
        while True:
            while queue and queue[0].next_row == queue[0].rows:
                queue.popleft()  # expired or cancelled while waiting
            if not queue:
                if self._closing and not self.inflight:
                    return
                await self._sleep(None)
                continue
            if self.inflight >= self.max_inflight:
                await self._sleep(None)  # a finished batch wakes us; the queue keeps growing
                continue
            if self.queued_rows < self.max_batch_size and not self._closing:
                wait = queue[0].t_enqueue + self.max_delay - _clock()
                if wait > 0:
                    await self._sleep(loop.time() + wait)
                    continue
            self._dispatch_batch()

    def _dispatch_batch(self) -> None:
        queue = self._queue
        room = self.max_batch_size
        pieces: list[tuple] = []
        starts: list[int] = []
        counts: list[int] = []
        owners: list[Pending] = []
        now = _clock()
        enqueued: list[float] = []
        while queue and room:
            p = queue[0]
            if p.future.done() and p.next_row < p.rows:
                self.cancel(p)  # its future was cancelled by the caller (Server.submit)
            left = p.rows - p.next_row
            if not left:
                queue.popleft()
                continue
            take = left if left <= room else room
            if p.next_row == 0:
                if p.timer is not None:
                    p.timer.cancel()
                    p.timer = None
                enqueued.append(p.t_enqueue)
            pieces.append(p.arrays)
            starts.append(p.next_row)
            counts.append(take)
            owners.append(p)
            p.next_row += take
            room -= take
            if take == left:
                queue.popleft()
        rows = self.max_batch_size - room
        self.queued_rows -= rows
        self._metrics.stages["queue"].observe_since(now, enqueued)
        try:
            bucket = self.model.bucket(dispatch.smallest_bucket(self._buckets, rows))
            job = dispatch.BatchJob(bucket, pieces, starts, counts, rows, owners, self.copy)
            self.pipeline.submit(job)
        except Exception as exc:  # noqa: BLE001 - answer the batch's callers, keep serving
            err = ExecutionFailed(f"model {self.name!r}: could not dispatch a batch: {exc!r}")
            self._fail(owners, err)
            return
        self.inflight += 1

    # ------------------------------------------------------------------ results

    def _on_done_threadsafe(self, job: dispatch.BatchJob) -> None:
        # On the pipeline's fetcher thread: one hop to the loop per batch.
        self._loop.call_soon_threadsafe(self._on_done, job)

    def _on_done(self, job: dispatch.BatchJob) -> None:
        self.inflight -= 1
        self._wake()
        m = self._metrics
        m.batches += 1
        m.batch_rows.observe(job.rows)
        m.padding.observe(1.0 - job.rows / job.bucket.size)
        if job.error is not None:
            err = ExecutionFailed(
                f"model {self.name!r}, bucket {job.bucket.size}: the batch failed: "
                f"{type(job.error).__name__}: {job.error}"
            )
            err.__cause__ = job.error
            self._fail(job.context, err)
            return
        stages = m.stages
        stages["compute_input"].observe((job.t_dispatched - job.t_start) * 1e6)
        stages["compute_infer"].observe((job.t_fetched - job.t_dispatched) * 1e6)
        stages["compute_output"].observe((job.t_done - job.t_fetched) * 1e6)
        self._deliver(job, 0)

    def _deliver(self, job: dispatch.BatchJob, first: int) -> None:
        # Each resolved future wakes its caller in the next loop iteration; resolving a
        # big batch in slices lets other events (new requests, I/O) in between them.
        last = min(first + DELIVER_SLICE, len(job.context))
        if last < len(job.context):
            self._loop.call_soon(self._deliver, job, last)
        enqueued: list[float] = []
        for i in range(first, last):
            p, out, start, count = job.context[i], job.outputs[i], job.starts[i], job.counts[i]
            fut = p.future
            if fut.done():
                continue  # cancelled after dispatch, or another part of it failed
            if count == p.rows:
                fut.set_result(out)
            else:
                if p.parts is None:
                    p.parts = []
                p.parts.append((start, out))
                p.rows_done += count
                if p.rows_done < p.rows:
                    continue
                parts = [o for _, o in sorted(p.parts, key=lambda t: t[0])]
                fut.set_result(dispatch.join_pieces(parts, self.copy))
            enqueued.append(p.t_enqueue)
        if enqueued:
            self._counts["success"] += len(enqueued)
            self._metrics.stages["request"].observe_since(_clock(), enqueued)

    def _fail(self, owners: list[Pending], err: BaseException) -> None:
        for p in owners:
            if not p.future.done():
                self._counts["failed"] += 1
                p.future.set_exception(err)

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        """Stop accepting, answer every accepted request, then stop the pipeline."""
        self._closing = True
        self._wake()
        await self._task
        await asyncio.to_thread(self.pipeline.close)


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _measure_row_seconds(model: Any) -> float:
    """Seconds per row of the largest bucket, for retry-after estimates."""
    rows = model.max_batch
    request = {k: np.zeros((rows,) + s.shape, s.dtype) for k, s in model.inputs.items()}
    model.run(request)
    t0 = time.perf_counter()
    model.run(request)
    return (time.perf_counter() - t0) / rows
