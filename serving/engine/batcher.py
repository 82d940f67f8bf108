"""Dynamic batching of one model's requests on the event loop: queue policy only.

The per-request work (validating, queueing, packing batches, answering futures) is the
model engine's ``BatchQueue`` (Cython); executing batches is its ``Pipeline`` (worker
threads). A ``Batcher`` decides when a batch goes:

- eagerly when idle: with no batch in flight, whatever waits goes at once (requests that
  arrive in the same loop iteration go together);
- while a batch runs, the next one goes into a free pipeline slot only when it is full
  (``max_batch_size`` rows); otherwise the batch in flight sends it when it finishes, so
  under load batches grow by themselves while the device is busy. The extra slots
  overlap one batch's host work with another's execution; they are not extra devices;
- with ``max_delay_us`` > 0, an idle pipeline also waits until ``max_batch_size`` rows
  are queued or the oldest request has waited that long;
- never so late that a queued request's deadline would pass (it goes early instead).

A model with named dimensions has a lane per set of compiled lengths, and each request
waits in the cheapest lane that holds it. The lane of the oldest request goes first; how
big its batch is (which cell) and which shorter requests ride along in it (paying padding
instead of waiting for a batch of their own) is decided from each cell's execution time
measured at load (``cell_policy="cost"``, see ``serving.engine.policy.choose_cell``); ``"oldest"``
runs the lane of the oldest request alone, up to ``max_batch_size`` rows. While a batch
runs, a lane goes when it fills its batch, or once its oldest request has waited as long
as the lane's own batch takes to run (or ``max_delay``, if longer): a lane few requests
take is not left waiting for the pipeline to empty while busier lanes keep it full.

Queue policy: a full queue rejects at once (``Overloaded``, with a retry-after
estimate); a request whose deadline passes while queued is answered
``DeadlineExceeded`` and never executed (checked when batches are taken, and by one
timer per model while requests wait); a caller that cancels before its request is
dispatched removes it. Metrics are updated once per batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from pxrt import Model
from pxrt.dispatch import Batch, Request

from ..errors import DeadlineExceeded, ExecutionFailed, Overloaded, ServerClosed
from ..options import BatchingOptions, OptionError
from .cache import CachedEntry, ResponseCache
from .metrics import Metrics
from .policy import Choice, choose_cell, efficient_cap

# Measurements use perf_counter: uvloop's loop.time() moves in whole milliseconds.
_clock = time.perf_counter
INF = math.inf
NEVER = 1 << 62  # a kick_rows no queue reaches
# How long before a queued deadline a waiting batch is closed, beyond a full batch's
# execution time: loop timers fire up to a millisecond early (asyncio) and, on a busy or
# virtual machine, several late. Each batcher widens its own margin to twice the
# lateness its delay timers show (at most MAX_TIMER_SLACK_S), narrowing it slowly again.
TIMER_SLACK_S = 10e-3
MAX_TIMER_SLACK_S = 0.1
# A warm load's stored cell times are measured again this long after the model starts
# serving, while it is idle (polled this often while it is not).
REMEASURE_AFTER_S = 30.0
REMEASURE_POLL_S = 1.0

log = logging.getLogger("pxrt")


class RequestTooLarge(ValueError):
    """A request with more rows than the queue may ever hold: retrying cannot help."""


class Batcher:
    """Batches one model's requests. Create and use it on the event loop's thread.

    Requests come in through ``queue.submit`` (``Server.infer`` calls it directly); the
    queue calls back into this object, its policy, for the decisions that are not
    per-request: ``kick`` (a batch could go), ``arm_sweep``, and the errors.
    """

    def __init__(
        self,
        name: str,
        model: Model,
        metrics: Metrics,
        options: BatchingOptions = BatchingOptions(),
        quiet: Callable[[], bool] | None = None,
        cache: ResponseCache | None = None,
    ) -> None:
        self.name = name
        # When re-measuring may run: nothing of this model waits or runs, nor, given
        # ``quiet`` (the server's), of any other model sharing the devices and cores.
        self._quiet = quiet or self._idle
        self.model = model
        self.options = options
        engine = model.engine
        max_batch_size = options.max_batch_size
        self.max_batch_size = min(max_batch_size or engine.max_rows, engine.max_rows)
        self.max_delay = options.max_delay_us * 1e-6
        self.max_queue = max_queue = options.max_queue
        # With several instances, each keeps max_inflight batches in flight; the model
        # is idle (a request goes at once) while one of them is.
        self.instances = instances = engine.instances
        self.max_inflight = max_inflight = options.max_inflight * instances
        self.default_timeout_s = default_timeout_s = options.default_timeout_s
        self.copy = copy = options.copy
        self._loop = asyncio.get_running_loop()
        levels = options.priority_levels
        self.queue = engine.queue(max_queue, self, self._loop.create_future, levels)
        self.queue.default_timeout = INF if default_timeout_s is None else default_timeout_s
        self.queue.default_level = options.default_priority_level or levels
        self.queue.aging = options.priority_wait_ms * 1e-3
        #: Requests being traced -> their traces (``submit_traced``): their batches'
        #: clocks go there.
        self.traced: dict[Any, Any] = {}
        #: Where requests come in: the queue, or the response cache in front of it.
        self.entry: Any = self.queue
        self.cached: CachedEntry | None = None
        if options.response_cache:
            if cache is None:
                raise OptionError(
                    f"option response_cache: model {name!r} asks for it but the server has "
                    "no response cache (Server(response_cache_mb=...), pxrt serve "
                    "--response-cache-mb)"
                )
            self.entry = self.cached = CachedEntry(self.queue, cache, copy)
        self.inflight = 0
        self._delay_timer: asyncio.TimerHandle | None = None
        self._delay_at = 0.0  # when the delay timer is due (_clock)
        self._timer_slack = TIMER_SLACK_S
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._drained = asyncio.Event()
        self._close_task: asyncio.Task | None = None
        # Outcomes counted here and by front ends; the queue counts the rest itself.
        self._counts = dict.fromkeys(("success", "failed", "invalid"), 0)
        self.cell_policy = options.cell_policy
        self.lanes = engine.lanes
        self._fold_lanes = engine.fold_lanes
        #: Per lane: the most rows of one batch.
        self.lane_caps = [min(self.max_batch_size, lane.max_rows) for lane in self.lanes]
        # Seconds per row of the batches that run, for retry-after estimates, and the
        # execution time of a full batch, to close a waiting batch before a deadline
        # (the costliest lane's, for named dimensions).
        #: Per lane: the rows of its most efficient bucket (least time per row) within
        #: its cap: the cost policy's batches go no bigger.
        self._derive_from_times()

        self._metrics = metrics.add_model(name, self, model.version)
        self.pipeline = engine.pipeline(
            self._on_done_threadsafe, workers=max_inflight, copy=copy, name=name
        )
        # Cell times an earlier load measured are timed again once the model is idle.
        self._remeasure_task: asyncio.Task | None = None
        if getattr(model, "stale_cells", None):
            self._remeasure_task = self._loop.create_task(self._remeasure())

    def _derive_from_times(self) -> None:
        """What the policy derives from the buckets' execution times."""
        self._efficient_caps = [
            efficient_cap(lane.buckets, cap, lane.bucket_for(cap).size)
            for lane, cap in zip(self.lanes, self.lane_caps)
        ]
        full = [lane.bucket_for(cap) for lane, cap in zip(self.lanes, self.lane_caps)]
        self._row_seconds = max(b.exec_s / b.size for b in full)
        self._full_exec_s = max(b.exec_s for b in full)
        # Per lane: how long its oldest request waits for a full batch while others run
        # (the lane's own batch time, or max_delay if longer), then goes unfilled.
        caps = self._efficient_caps if self.cell_policy == "cost" else self.lane_caps
        self._lane_wait_s = [
            max(self.max_delay, lane.bucket_for(cap).exec_s) for lane, cap in zip(self.lanes, caps)
        ]

    def _idle(self) -> bool:
        return self.inflight == 0 and self.queue.queued_rows == 0 and not self.queue.closed

    async def _remeasure(self) -> None:
        """Time again, in the background, the cells whose times a warm load read from an
        earlier one (``Model.remeasure``): one cell at a time on a worker thread, only
        while no request waits or runs, of this model or of any other the server serves
        (timed beside another model's batches, a cell measured up to 10x its time, and
        the cost policy's caps followed); never before ``REMEASURE_AFTER_S``."""
        await asyncio.sleep(REMEASURE_AFTER_S)
        model = self.model
        while model.stale_cells and not self.queue.closed:
            if not self._quiet():
                await asyncio.sleep(REMEASURE_POLL_S)
                continue
            try:
                await asyncio.to_thread(model.remeasure, self._quiet, 1)
            except Exception as exc:  # noqa: BLE001 - the stored times stay
                log.warning("pxrt: %r: re-measuring its cells failed: %r", self.name, exc)
                return
            self._derive_from_times()

    # ------------------------------------------------------------------ policy

    def kick(self) -> None:
        """Called by ``queue.submit`` once ``queue.kick_rows`` rows wait."""
        self._loop.call_soon(self._flush)

    def arm_sweep(self, deadline: float) -> None:
        """Called by ``queue.submit`` when a deadline earlier than ``queue.sweep_at``
        arrives: one timer per model answers requests whose deadline passes while they
        wait (the device busy with earlier batches); no timer per request."""
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
        self.queue.sweep_at = deadline
        self._sweep_timer = self._loop.call_later(max(deadline - _clock(), 0.0), self._sweep)

    def expired_error(self, r: Request) -> Exception:
        waited = (r.deadline - r.t_enqueue) * 1e3
        return DeadlineExceeded(
            f"model {self.name!r}: the request's deadline ({waited:.1f} ms) passed while "
            "it was queued; it was not executed"
        )

    def refused_error(self, rows: int) -> Exception:
        if rows > self.max_queue:
            return RequestTooLarge(
                f"model {self.name!r}: the request has {rows} rows but the queue holds at "
                f"most {self.max_queue} (max_queue); send it in parts of at most "
                f"{self.max_queue} rows"
            )
        queued = self.queue.queued_rows
        wait = max(queued * self._row_seconds, 1e-3)
        return Overloaded(
            f"model {self.name!r} is overloaded: {queued} rows queued, max_queue is "
            f"{self.max_queue}; retry after {wait:.3f} s",
            retry_after_s=wait,
        )

    def closed_error(self) -> Exception:
        return ServerClosed(f"model {self.name!r} is shutting down; not accepting requests")

    # ------------------------------------------------------------------ metrics source

    def count(self, outcome: str) -> None:
        """A request that a front end answered before it reached the queue (``invalid``:
        it did not follow the protocol) or after it left it (``failed``: encoding the
        reply failed)."""
        self._counts[outcome] += 1

    def outcomes(self) -> dict[str, int]:
        q = self.queue
        hits = self.cached.hits if self.cached is not None else 0
        return {
            "success": self._counts["success"] + hits,
            "invalid": q.invalid + self._counts["invalid"],
            "rejected": q.rejected,
            "expired": q.expired,
            "failed": self._counts["failed"],
            "cancelled": q.cancelled,
        }

    def queued_rows(self) -> int:
        return self.queue.queued_rows

    def cache_counts(self) -> dict[str, float] | None:
        """The response cache's hits and misses (and the seconds each took), or None
        when the model does not use it."""
        return self.cached.counts() if self.cached is not None else None

    def compiles(self) -> int:
        return self.model.compiles_after_load

    def instance_batches(self) -> list[int]:
        return list(self.model.engine.instance_batches)

    def load_phases(self) -> dict[str, float]:
        return {"total": self.model.load_s, **getattr(self.model, "load_phases", {})}

    def drain_timings(self) -> None:
        stages = self._metrics.stages
        stages["queue"].observe_many(self.queue.drain_waits())
        stages["request"].observe_many(self.queue.drain_latencies())

    # ------------------------------------------------------------------ forming

    def _flush(self) -> None:
        """Send batches while pipeline slots are free and requests wait: at once when
        the pipeline is idle; while a batch runs, only a full one (the one running sends
        the rest when it finishes); never so late that a queued deadline passes. Then
        tell the queue when to kick us again."""
        if len(self.lanes) > 1:
            return self._flush_lanes()
        queue = self.queue
        queue.kick_rows = NEVER
        while self.inflight < self.max_inflight and queue.queued_rows:
            now = _clock()
            if queue.queued_rows < self.max_batch_size and not queue.closed:
                # Go early enough that the request with the earliest deadline is taken
                # (and could run) before it: loop timers fire up to ~1 ms off.
                due = queue.earliest_deadline - self._full_exec_s - self._timer_slack
                if self.inflight < self.instances and self.max_delay:
                    due = min(due, queue.oldest + self.max_delay)
                elif self.inflight < self.instances:
                    due = now
                if due > now:
                    if due < INF:
                        self._arm_delay(due - now)
                    queue.kick_rows = self.max_batch_size  # a full batch goes at once
                    return
            batch = queue.take(self.max_batch_size, now)
            if batch is None:
                break
            self._dispatch(batch)
        if self.inflight < self.max_inflight:
            # Idle: the next request goes at once; busy: the next full batch does.
            queue.kick_rows = self.max_batch_size if self.inflight >= self.instances else 1
        if queue.closed and not self.inflight and not queue.queued_rows:
            self._drained.set()

    def _flush_lanes(self) -> None:
        """``_flush`` for a model with several lanes: the same rules, with ``_choose``
        deciding which lane goes and what rides along."""
        queue = self.queue
        queue.kick_rows = NEVER
        while self.inflight < self.max_inflight and queue.queued_rows:
            now = _clock()
            idle = self.inflight < self.instances
            if idle and queue.queued_rows < self.max_batch_size and not queue.closed:
                due = queue.earliest_deadline - self._full_exec_s - self._timer_slack
                due = min(due, queue.oldest + self.max_delay) if self.max_delay else now
                if due > now:
                    if due < INF:
                        self._arm_delay(due - now)
                    queue.kick_rows = self.max_batch_size
                    return
            # Busy: only a full batch goes, unless a queued deadline is due.
            due = queue.earliest_deadline - self._full_exec_s - self._timer_slack
            full_only = self.inflight >= self.instances and not queue.closed and due > now
            choice = self._choose(now, full_only)
            if choice is None:
                break
            lane, fold, rows = choice
            batch = queue.take(rows, now, lane, fold)
            if batch is None:
                continue  # what waited was given up or expired: look again
            self._dispatch(batch)
        if self.inflight < self.max_inflight:
            # Idle: the next request goes at once; busy: look again as rows arrive, for
            # a lane that fills a batch, and when the earliest deadline comes due.
            busy = self.inflight >= self.instances
            queue.kick_rows = max(min(self.lane_caps), queue.queued_rows + 1) if busy else 1
            if busy and queue.queued_rows:
                due = queue.earliest_deadline - self._full_exec_s - self._timer_slack
                if due < INF:
                    self._arm_delay(max(due - _clock(), 0.0))
        if queue.closed and not self.inflight and not queue.queued_rows:
            self._drained.set()

    def _dispatch(self, batch: Batch) -> None:
        """Hand ``batch`` to the pipeline; if that fails, its callers get the error and
        serving goes on."""
        try:
            self.pipeline.submit(batch)
        except Exception as exc:  # noqa: BLE001 - answer the batch's callers, keep serving
            self._fail(batch, f"could not dispatch a batch: {exc!r}", exc)
            return
        self.inflight += 1

    def _choose(self, now: float, full_only: bool) -> Choice | None:
        """The next batch of a model with several lanes (``policy.choose_cell``)."""
        cost = self.cell_policy == "cost"
        caps = self._efficient_caps if cost else self.lane_caps
        queue = self.queue
        stats = [queue.lane_stats(k, caps[k], now) for k in range(len(self.lanes))]
        stale = [now - wait for wait in self._lane_wait_s] if full_only else None
        return choose_cell(
            self.cell_policy, stats, caps, self._exec_s, self._fold_lanes, full_only, stale
        )

    def _exec_s(self, lane: int, rows: int) -> float:
        return self.lanes[lane].bucket_for(rows).exec_s

    def _arm_delay(self, delay: float) -> None:
        if self._delay_timer is not None:
            self._delay_timer.cancel()
        self._delay_timer = self._loop.call_later(delay, self._on_delay)
        self._delay_at = _clock() + delay

    def _on_delay(self) -> None:
        self._delay_timer = None
        late = _clock() - self._delay_at
        self._timer_slack = min(
            max(TIMER_SLACK_S, self._timer_slack * 0.99, 2 * late), MAX_TIMER_SLACK_S
        )
        self._flush()

    def _sweep(self) -> None:
        self._sweep_timer = None
        self.queue.sweep_at = INF
        earliest = self.queue.sweep(_clock())
        if earliest < INF:
            self.arm_sweep(earliest)
        if self.queue.closed:
            self._flush()

    # ------------------------------------------------------------------ results

    def _on_done_threadsafe(self, batch: Batch) -> None:
        # On a pipeline worker: one hop to the loop per batch.
        self._loop.call_soon_threadsafe(self._on_done, batch)

    def submit_traced(
        self, request: Any, timeout_s: float | None, priority: int, trace: Any
    ) -> asyncio.Future:
        """Queue a request being traced: ``trace`` gets the clocks of each batch that
        runs its rows (or, answered from the response cache, notes the hit)."""
        queued = self.entry.submit(request, timeout_s, priority)
        future = queued.future
        if future.done():  # (the response cache answered it)
            trace.hit = True
            return future
        t_queued = trace.marks[-1][2] if trace.marks else trace.t0
        traced = self.traced
        traced[queued] = (trace, t_queued)
        future.add_done_callback(lambda _: traced.pop(queued, None))
        return future

    def _on_done(self, batch: Batch) -> None:
        self.inflight -= 1
        self._flush()  # the next batch goes out before this one's callers are answered
        if self.traced:
            for r in batch.requests:
                seen = self.traced.get(r)
                if seen is not None:
                    trace, t_queued = seen
                    trace.batch(t_queued, batch)
                    self.traced[r] = (trace, batch.t_done)  # (its next piece waits from here)
        m = self._metrics
        m.batches += 1
        if batch.bucket is not None and batch.error is None:
            m.batch_rows.observe(batch.rows)
            m.padding.observe(1.0 - batch.fill)  # rows and, for named dims, lengths
        if batch.error is not None:
            where = "no bucket"
            if batch.bucket is not None:
                at = dict(zip(self.model.dim_names, batch.bucket.lengths))
                where = f"bucket {batch.bucket.size}" + (f" at {at}" if at else "")
            self._fail(
                batch,
                f"{where}: the batch failed: {type(batch.error).__name__}: {batch.error}",
                batch.error,
            )
        else:
            stages = m.stages
            stages["compute_input"].observe((batch.t_dispatched - batch.t_start) * 1e6)
            stages["compute_infer"].observe((batch.t_fetched - batch.t_dispatched) * 1e6)
            stages["compute_output"].observe((batch.t_done - batch.t_fetched) * 1e6)
            self._counts["success"] += self.queue.deliver(batch, self.copy)
            if self.queue.timings_pending >= 8192:
                self.drain_timings()
        if self.queue.closed and not self.inflight and not self.queue.queued_rows:
            self._drained.set()

    def _fail(self, batch: Batch, message: str, cause: BaseException) -> None:
        err = ExecutionFailed(f"model {self.name!r}, {message}")
        err.__cause__ = cause
        self._counts["failed"] += self.queue.fail(batch, err)

    # ------------------------------------------------------------------ shutdown

    def closing(self) -> asyncio.Task:
        """Start closing (once, however many callers ask): the task that stops accepting,
        answers every accepted request, then stops the pipeline."""
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        return self._close_task

    async def close(self) -> None:
        """Stop accepting, answer every accepted request, then stop the pipeline. A
        caller cancelled while it waits stops waiting; the closing goes on."""
        await asyncio.shield(self.closing())

    async def _close(self) -> None:
        self.queue.closed = True
        if self._remeasure_task is not None:
            self._remeasure_task.cancel()
        self._flush()
        await self._drained.wait()
        for timer in (self._delay_timer, self._sweep_timer):
            if timer is not None:
                timer.cancel()
        await asyncio.to_thread(self.pipeline.close)
        if self.cached is not None:
            self.cached.close()
