"""Pure-Python twin of ``pxrt._batch`` (used with PXRT_NO_EXTENSIONS=1).

Same interface and same behaviour; tests drive both with the same sequences of
operations and compare every answer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from .contracts import InputHandling, QueuePolicy

INF = math.inf
_NEVER = 1 << 62
_clock = time.perf_counter


def join_pieces(parts: list, copy: bool) -> dict[str, np.ndarray]:
    """One request's outputs from its pieces' ``(start, outputs)``, in row order;
    read-only unless ``copy``, like every output pxrt hands out."""
    parts.sort(key=lambda part: part[0])
    out = {k: np.concatenate([p[1][k] for p in parts]) for k in parts[0][1]}
    if not copy:
        for arr in out.values():
            arr.flags.writeable = False
    return out


class Request:
    """One accepted request, from ``BatchQueue.push`` until it is answered.

    A request with a future is awaitable: ``await request`` is ``await request.future``
    (the future's own C iterator, nothing in between). It also speaks the coroutine
    protocol (``send``/``throw``/``close``), so ``asyncio.create_task``,
    ``run_coroutine_threadsafe`` and friends take it as they take a coroutine.
    """

    __slots__ = (
        "arrays",
        "rows",
        "future",
        "t_enqueue",
        "deadline",
        "lane",
        "level",
        "next_row",
        "rows_done",
        "parts",
        "finished",
        "result",
        "error",
        "_steps",
    )

    def __init__(
        self,
        arrays: tuple,
        rows: int,
        future: Any,
        now: float,
        deadline: float,
        lane: int = 0,
        level: int = 1,
    ) -> None:
        self.arrays = arrays
        self.lane = lane
        self.level = level
        self.rows = rows
        self.future = future
        self.t_enqueue = now
        self.deadline = deadline
        self.next_row = 0
        self.rows_done = 0
        self.parts: list | None = None
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._steps: Any = None

    def __await__(self) -> Any:
        return self.future.__await__()

    def __iter__(self) -> Request:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        if self._steps is None:
            self._steps = self.future.__await__()
        return self._steps.send(value)

    def throw(self, *args: Any) -> Any:
        if self._steps is None:
            self._steps = self.future.__await__()
        return self._steps.throw(*args)

    def close(self) -> None:
        self._steps = None


class Batch:
    """Rows for one execution: piece ``i`` is rows ``starts[i]:starts[i]+counts[i]`` of
    ``requests[i]`` (whose inputs are ``pieces[i]``), at rows ``offsets[i]:...`` of the
    batch. The engine fills ``bucket``, ``outputs`` (one dict per piece) or ``error``,
    ``fill`` (the share of the cell's elements that are the requests', not padding) and
    the stage clocks (perf_counter)."""

    __slots__ = (
        "pieces",
        "starts",
        "counts",
        "offsets",
        "requests",
        "rows",
        "lane",
        "bucket",
        "outputs",
        "error",
        "fill",
        "t_start",
        "t_dispatched",
        "t_fetched",
        "t_done",
    )

    def __init__(self) -> None:
        self.pieces: list[tuple] = []
        self.starts: list[int] = []
        self.counts: list[int] = []
        self.offsets: list[int] = []
        self.requests: list[Request | None] = []  # None: Batch.single's piece
        self.rows = 0
        self.lane = 0
        self.bucket: Any = None
        self.outputs: list[dict] | None = None
        self.error: BaseException | None = None
        self.fill = 0.0
        self.t_start = self.t_dispatched = self.t_fetched = self.t_done = 0.0

    @staticmethod
    def single(arrays: tuple, rows: int, lane: int = 0) -> Batch:
        """A batch of one whole request that no queue tracks (``Model.run``)."""
        batch = Batch()
        batch.lane = lane
        batch.pieces.append(arrays)
        batch.starts.append(0)
        batch.counts.append(rows)
        batch.offsets.append(0)
        batch.requests.append(None)
        batch.rows = rows
        return batch

    def _add(self, r: Request, start: int, count: int) -> None:
        self.pieces.append(r.arrays)
        self.starts.append(start)
        self.counts.append(count)
        self.offsets.append(self.rows)
        self.requests.append(r)
        self.rows += count

    def __len__(self) -> int:
        return len(self.requests)


class BatchQueue:
    """Accepted requests in arrival order, and the batches made of them.

    Args:
      max_queued_rows: a request that would make the rows waiting exceed this is
        refused (0: no limit).
      handler: the model's ``InputHandler``; ``submit`` validates with it.
      policy: for ``submit``: the serving side's decisions, an object with
        ``kick()`` (enough rows wait for a batch: see ``kick_rows``),
        ``arm_sweep(deadline)`` (a deadline earlier than ``sweep_at`` arrived),
        ``expired_error(request)``, ``refused_error(rows)`` and ``closed_error()``
        (the exceptions for those outcomes).
      create_future: for ``submit``: makes each request's future.
      lanes: the compiled lengths' lanes (named dimensions; 1 without).
      levels: priority levels (Triton's): level 1 is taken first, then 2, ...; a request
        that has waited ``aging`` seconds goes before every level, oldest first, so no
        level starves. A request without one is at ``default_level`` (the lowest).

    Not thread-safe: use it from one thread (the event loop's, when serving), except
    ``drain_waits``/``drain_latencies``, which any thread may call.
    """

    def __init__(
        self,
        max_queued_rows: int = 0,
        handler: InputHandling | None = None,
        policy: QueuePolicy | None = None,
        create_future: Callable[[], Any] | None = None,
        lanes: int = 1,
        levels: int = 1,
    ) -> None:
        if lanes < 1:
            raise ValueError(f"a queue needs at least 1 lane, got {lanes}")
        if levels < 1:
            raise ValueError(f"a queue needs at least 1 priority level, got {levels}")
        self.lanes = lanes
        self.levels = levels
        self.default_level = levels
        self.aging = INF
        # One FIFO per lane and level: FIFO q = lane * levels + level - 1 is
        # _items[q][_heads[q]:]; lane k holds _lane_rows[k] rows over its levels.
        self._items: list[list[Request | None]] = [[] for _ in range(lanes * levels)]
        self._heads = [0] * (lanes * levels)
        self._lane_rows = [0] * lanes
        self.queued_rows = 0
        self.max_queued_rows = max_queued_rows if max_queued_rows > 0 else _NEVER
        self.earliest_deadline = INF
        self.refused_rows = 0
        self.invalid = self.rejected = self.expired = self.cancelled = 0
        self._handler = handler
        self._policy = policy
        self._create_future = create_future
        self.default_timeout = INF
        self.kick_rows = 1 if policy is not None else _NEVER
        self.sweep_at = INF
        self.closed = False
        self._waits: list[float] = []
        self._latencies: list[float] = []

    def __len__(self) -> int:
        return sum(len(items) - head for items, head in zip(self._items, self._heads))

    @property
    def oldest(self) -> float:
        """When the oldest request still waiting was queued (+inf: none waits)."""
        return min((self._lane_oldest(k) for k in range(self.lanes)), default=INF)

    def _waiting(self, q: int) -> list[Request]:
        # FIFO ``q``'s entries from its head on (the taken ones before it are None).
        return cast("list[Request]", self._items[q][self._heads[q] :])

    def _lane_oldest(self, lane: int) -> float:
        oldest = INF
        for q in range(lane * self.levels, (lane + 1) * self.levels):
            for r in self._waiting(q):
                if not r.finished:
                    oldest = min(oldest, r.t_enqueue)
                    break
        return oldest

    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self.lanes:
            raise IndexError(f"lane {lane} of {self.lanes}")

    def lane_rows(self, lane: int) -> int:
        """Rows waiting in ``lane``."""
        self._check_lane(lane)
        return self._lane_rows[lane]

    def lane_stats(self, lane: int, max_rows: int, now: float) -> tuple[int, int, float, float]:
        """``(rows, requests, age_sum, oldest)`` of the first ``max_rows`` rows waiting
        in ``lane``: what a batch taken from it now would hold (a request counted whole
        if any of its rows would go), the sum of their waits so far (s), and when the
        oldest of them was queued (+inf: none)."""
        self._check_lane(lane)
        rows = n = 0
        ages = 0.0
        oldest = INF
        for q in range(lane * self.levels, (lane + 1) * self.levels):  # (in priority order)
            for r in self._waiting(q):
                if rows >= max_rows:
                    break
                if r.finished:
                    continue
                rows += min(r.rows - r.next_row, max_rows - rows)
                n += 1
                ages += now - r.t_enqueue
                oldest = min(oldest, r.t_enqueue)
        return rows, n, ages, oldest

    @property
    def timings_pending(self) -> int:
        """Waits and latencies logged and not drained yet."""
        return len(self._waits) + len(self._latencies)

    def drain_waits(self) -> np.ndarray:
        """The queue waits (s) logged since the last drain, as a float64 array."""
        values, self._waits = self._waits, []
        return np.array(values, np.float64)

    def drain_latencies(self) -> np.ndarray:
        """The request latencies (s) logged since the last drain, as a float64 array."""
        values, self._latencies = self._latencies, []
        return np.array(values, np.float64)

    # ------------------------------------------------------------------ accepting

    def _level(self, priority: int) -> int:
        if priority == 0:
            return self.default_level
        if not 1 <= priority <= self.levels:
            raise ValueError(
                f"priority {priority!r} is not a level of this model: 1 (the highest) to "
                f"{self.levels}, or 0 for its default ({self.default_level})"
            )
        return priority

    def _push(
        self,
        arrays: tuple,
        rows: int,
        future: Any,
        now: float,
        deadline: float,
        lane: int,
        level: int,
    ) -> Request | None:
        self._check_lane(lane)
        if rows < 1:
            raise ValueError(f"a request needs at least 1 row, got {rows}")
        if self.queued_rows + rows > self.max_queued_rows:
            self.sweep(now)
            if self.queued_rows + rows > self.max_queued_rows:
                self.refused_rows = rows
                return None
        r = Request(arrays, rows, future, now, deadline, lane, level)
        self._items[lane * self.levels + level - 1].append(r)
        self.queued_rows += rows
        self._lane_rows[lane] += rows
        if deadline < self.earliest_deadline:
            self.earliest_deadline = deadline
        return r

    def push(
        self,
        arrays: tuple,
        rows: int,
        future: Any = None,
        deadline: float = INF,
        lane: int = 0,
        priority: int = 0,
    ) -> Request | None:
        """Queue a prepared request (``InputHandler.prepare``'s arrays and rows) in
        ``lane`` at level ``priority`` (0: the default); None when its rows do not fit
        under ``max_queued_rows`` (requests whose callers gave up are dropped first, so
        they never hold room)."""
        level = self._level(priority)
        return self._push(arrays, rows, future, _clock(), deadline, lane, level)

    def submit(self, request: Any, timeout: float | None = None, priority: int = 0) -> Request:
        """Admit one request for serving: validate it, give it a future and a deadline
        ``timeout`` seconds from now (None: ``default_timeout``) and its priority level
        (``priority``; 0: ``default_level``), queue it, and kick the policy when
        ``kick_rows`` rows wait. Raises the handler's TypeError/ValueError for a
        malformed request (ValueError for a priority that is no level), and the policy's
        errors when closed or refused."""
        if self._handler is None or self._policy is None or self._create_future is None:
            raise RuntimeError(
                "submit needs a queue made with a handler, a policy and create_future"
            )
        if self.closed:
            raise self._policy.closed_error()
        try:
            level = self._level(priority) if priority else self.default_level
            arrays, rows = self._handler.prepare(request)
            lane = self._handler.lane_of(arrays) if self.lanes > 1 else 0
        except (TypeError, ValueError):
            self.invalid += 1
            raise
        now = _clock()
        deadline = now + (self.default_timeout if timeout is None else float(timeout))
        r = self._push(arrays, rows, self._create_future(), now, deadline, lane, level)
        if r is None:
            error = self._policy.refused_error(rows)
            if isinstance(error, ValueError):
                self.invalid += 1
            else:
                self.rejected += 1
            raise error
        if self.queued_rows >= self.kick_rows:
            self.kick_rows = _NEVER  # once; the policy re-arms it
            self._policy.kick()
        if deadline < self.sweep_at:
            self.sweep_at = deadline
            self._policy.arm_sweep(deadline)
        return r

    # ------------------------------------------------------------------ batching

    def _drop_if_gone(self, r: Request, now: float) -> bool:
        # A request at the head that must not go into a batch: answered already, given
        # up by its caller, or past its deadline before any of it ran.
        if r.finished:
            return True
        if r.future is not None and r.future.done():
            self.cancel(r)
            return True
        if r.next_row == 0 and r.deadline <= now:
            if self._policy is not None:
                error = self._policy.expired_error(r)
            else:
                error = TimeoutError("the request's deadline passed while it was queued")
            self._finish(r, None, error)
            self.expired += 1
            return True
        return False

    def take(
        self, max_rows: int, now: float, lane: int = 0, fold: tuple | None = None
    ) -> Batch | None:
        """The next batch from ``lane``: its waiting requests in order, up to
        ``max_rows`` rows, then, while room is left, whole requests from the lanes in
        ``fold`` (in that order: lanes whose lengths fit this one's); None when nothing
        was taken. A request of ``lane`` that does not fit whole gives the rows that fit
        and then waits behind the requests queued after it for its next piece."""
        self._check_lane(lane)
        batch, room = self._take_lane(None, lane, max_rows, now, True)
        for k in fold or ():
            if room <= 0:
                break
            self._check_lane(k)
            batch, room = self._take_lane(batch, k, room, now, False)
        if batch is not None:
            batch.lane = lane
        if self.queued_rows == 0:
            self.earliest_deadline = INF
        return batch

    def _take_lane(
        self, batch: Batch | None, lane: int, room: int, now: float, split: bool
    ) -> tuple[Batch | None, int]:
        if self.levels == 1:
            return self._take_fifo(batch, lane, lane, room, now, split, _NEVER)
        while room > 0:  # by priority: the highest level's requests, aged ones first
            q, aged = self._next_fifo(lane, now)
            if q < 0:
                break
            before = room
            # With no aged request in the lane, the level's requests go in one run.
            batch, room = self._take_fifo(batch, q, lane, room, now, split, 1 if aged else _NEVER)
            if room == before:
                break  # (its next request does not fit)
        return batch, room

    def _next_fifo(self, lane: int, now: float) -> tuple[int, bool]:
        """The FIFO of ``lane`` to take from next: the oldest head that has waited
        ``aging``, else the highest level's (-1 when none waits); and whether any head
        has aged."""
        first = aged = -1
        aged_at = INF
        for q in range(lane * self.levels, (lane + 1) * self.levels):
            items = self._items[q]
            head = self._heads[q]
            while head < len(items) and self._drop_if_gone(cast(Request, items[head]), now):
                items[head] = None
                head += 1
            self._heads[q] = head
            if head == len(items):
                continue
            t = cast(Request, items[head]).t_enqueue
            if first < 0:
                first = q
            if now - t >= self.aging and t < aged_at:
                aged, aged_at = q, t
        return (aged, True) if aged >= 0 else (first, False)

    def _take_fifo(
        self,
        batch: Batch | None,
        q: int,
        lane: int,
        room: int,
        now: float,
        split: bool,
        most: int,
    ) -> tuple[Batch | None, int]:
        # Up to ``most`` requests (or the rows that fit) of FIFO ``q`` of ``lane``.
        items = self._items[q]
        head = self._heads[q]
        n = len(items)
        while head < n and room > 0 and most > 0:
            r = cast(Request, items[head])
            if self._drop_if_gone(r, now):
                items[head] = None
                head += 1
                continue
            left = r.rows - r.next_row
            if left > room:
                if not split:
                    break
                left = room
            if batch is None:
                batch = Batch()
            if r.next_row == 0:
                self._waits.append(now - r.t_enqueue)
            batch._add(r, r.next_row, left)
            r.next_row += left
            room -= left
            self.queued_rows -= left
            self._lane_rows[lane] -= left
            most -= 1
            if r.next_row == r.rows:
                items[head] = None  # the batch holds it now
                head += 1
        if split and room == 0 and head < n - 1 and cast(Request, items[head]).next_row:
            # A request split across batches waits behind the others for its next piece,
            # so a large request does not hold the requests behind it for all its batches.
            items.append(items[head])
            items[head] = None
            head += 1
            n += 1
        if head == n:
            del items[:]
            head = 0
        elif head > 1024 and 2 * head > n:
            del items[:head]
            head = 0
        self._heads[q] = head
        return batch, room

    # ------------------------------------------------------------------ answering

    def _finish(self, r: Request, result: Any, error: BaseException | None) -> int:
        # Answer r; 1 if this answered it, 0 if it was answered (or given up) before.
        if r.finished:
            return 0
        r.finished = True
        r.parts = None
        if r.next_row < r.rows:  # rows still waiting leave the queue with it
            self.queued_rows -= r.rows - r.next_row
            self._lane_rows[r.lane] -= r.rows - r.next_row
            r.next_row = r.rows
        if r.future is None:
            r.result = result
            r.error = error
            return 1
        try:
            if error is not None:
                r.future.set_exception(error)
            else:
                r.future.set_result(result)
        except Exception:
            if not r.future.done():
                raise
            self.cancelled += 1  # its caller gave up after it was taken into a batch
            return 0
        return 1

    def deliver(self, batch: Batch, copy: bool = False, now: float = -1.0) -> int:
        """Answer the requests of a batch whose ``outputs`` came back: each whole request
        gets its outputs, a split one once all its pieces are in. Logs each answered
        request's latency up to ``now`` (default: the clock); returns how many."""
        outputs = cast(list, batch.outputs)
        if len(outputs) != len(batch.requests):
            raise ValueError(f"{len(outputs)} outputs for a batch of {len(batch.requests)} pieces")
        if now < 0:
            now = _clock()
        answered = 0
        requests = cast("list[Request]", batch.requests)  # a queue's batches: no None
        for r, start, count, out in zip(requests, batch.starts, batch.counts, outputs):
            if r.finished:
                continue
            if count != r.rows:
                if r.parts is None:
                    r.parts = []
                r.parts.append((start, out))
                r.rows_done += count
                if r.rows_done < r.rows:
                    continue
                out = join_pieces(r.parts, copy)
            if self._finish(r, out, None):
                answered += 1
                self._latencies.append(now - r.t_enqueue)
        return answered

    def fail(self, batch: Batch, error: BaseException) -> int:
        """Answer every request of a failed batch with ``error`` (a split request
        fails whole); returns how many were answered."""
        answered = 0
        for r in cast("list[Request]", batch.requests):
            answered += self._finish(r, None, error)
        return answered

    def cancel(self, r: Request) -> bool:
        """Its caller gave up: rows not yet in a batch leave the queue, rows in one
        still run and their outputs are dropped. False if it was answered already."""
        if r.finished:
            return False
        r.finished = True
        r.parts = None
        self.queued_rows -= r.rows - r.next_row
        self._lane_rows[r.lane] -= r.rows - r.next_row
        r.next_row = r.rows
        self.cancelled += 1
        return True

    def sweep(self, now: float) -> float:
        """Answer the waiting requests whose deadline passed, drop the ones whose callers
        gave up; returns the earliest deadline among those still waiting (+inf)."""
        earliest = INF
        for q in range(self.lanes * self.levels):
            keep: list[Request | None] = []
            for r in self._waiting(q):
                if self._drop_if_gone(r, now):
                    continue
                keep.append(r)
                if r.next_row == 0 and r.deadline < earliest:
                    earliest = r.deadline
            self._items[q] = keep
            self._heads[q] = 0
        self.earliest_deadline = earliest
        return earliest
