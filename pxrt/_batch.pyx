# cython: language_level=3
"""Batch plans: the per-request work between accepting a request and answering it.

A ``BatchQueue`` holds accepted requests in arrival order. ``take`` packs them, in order,
into a ``Batch`` of at most ``max_rows`` rows, splitting a request that does not fit the
room left (its next rows go into the next batch); on the way it drops requests whose
callers gave up and answers the ones whose deadline passed. ``deliver`` hands each
request its outputs once all of its rows came back (joining the pieces of a split
request), and ``fail`` gives a failed batch's requests its error.

A request's answer goes to its future (``set_result``/``set_exception``, on the thread
that owns the queue: the event loop's), or, without a future, into ``result``/``error``
(synchronous plans, ``Model.run_batch``). Nothing here blocks or touches a device.

For serving, ``submit`` does all of a request's admission in one call: validation (the
model's ``InputHandler``), the deadline, the future, the queue bound, outcome counts, and
telling the serving policy when a batch could go (``policy.kick()``); waits and latencies
go into C buffers that the metrics drain per batch. ``_batch_py`` is the pure-Python
twin; tests hold the two to identical behaviour.
"""

from cpython.list cimport PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.math cimport INFINITY
from libc.string cimport memcpy

cimport numpy as cnp

from pxrt._handlers cimport InputHandler

import time

import numpy as np

cnp.import_array()

# Hot-path lookups cached as C-level globals.
cdef object _clock = time.perf_counter
cdef object _concatenate = np.concatenate
cdef object _empty = np.empty
cdef Py_ssize_t _NEVER = (<Py_ssize_t>1) << 62


def join_pieces(list parts, bint copy):
    """One request's outputs from its pieces' ``(start, outputs)``, in row order;
    read-only unless ``copy``, like every output pxrt hands out."""
    parts.sort(key=_start_of)
    first = parts[0][1]
    out = {k: _concatenate([p[1][k] for p in parts]) for k in first}
    if not copy:
        for arr in out.values():
            arr.flags.writeable = False
    return out


def _start_of(part):
    return part[0]


cdef int _log(TimeLog* log, double value) except -1:
    cdef Py_ssize_t cap
    cdef double* grown
    if log.n == log.cap:
        cap = log.cap * 2 if log.cap else 1024
        grown = <double*>PyMem_Realloc(log.values, cap * sizeof(double))
        if grown == NULL:
            raise MemoryError()
        log.values = grown
        log.cap = cap
    log.values[log.n] = value
    log.n += 1
    return 0


cdef object _drain(TimeLog* log):
    # Swap the buffer out before any Python call, so a drain on another thread never
    # races the loop's appends; then copy it into an array.
    cdef double* values = log.values
    cdef Py_ssize_t n = log.n
    log.values = NULL
    log.n = 0
    log.cap = 0
    cdef cnp.ndarray out = _empty(n, np.float64)
    if n:
        memcpy(cnp.PyArray_DATA(out), values, n * sizeof(double))
    PyMem_Free(values)
    return out


cdef class Request:
    """One accepted request, from ``BatchQueue.push`` until it is answered.

    A request with a future is awaitable: ``await request`` is ``await request.future``
    (the future's own C iterator, nothing in between). It also speaks the coroutine
    protocol (``send``/``throw``/``close``), so ``asyncio.create_task``,
    ``run_coroutine_threadsafe`` and friends take it as they take a coroutine.
    """


    def __await__(self):
        return self.future.__await__()

    def __iter__(self):
        return self

    def __next__(self):
        return self.send(None)

    def send(self, value):
        if self._steps is None:
            self._steps = self.future.__await__()
        return self._steps.send(value)

    def throw(self, *args):
        if self._steps is None:
            self._steps = self.future.__await__()
        return self._steps.throw(*args)

    def close(self):
        self._steps = None


cdef class Batch:
    """Rows for one execution: piece ``i`` is rows ``starts[i]:starts[i]+counts[i]`` of
    ``requests[i]`` (whose inputs are ``pieces[i]``), at rows ``offsets[i]:...`` of the
    batch. The engine fills ``bucket``, ``outputs`` (one dict per piece) or ``error``,
    ``fill`` (the share of the cell's elements that are the requests', not padding) and
    the stage clocks (perf_counter)."""

    def __cinit__(self):
        self.pieces = []
        self.starts = []
        self.counts = []
        self.offsets = []
        self.requests = []
        self.rows = 0

    @staticmethod
    def single(tuple arrays, Py_ssize_t rows, Py_ssize_t lane=0):
        """A batch of one whole request that no queue tracks (``Model.run``)."""
        cdef Batch batch = Batch.__new__(Batch)
        batch.lane = lane
        batch.pieces.append(arrays)
        batch.starts.append(0)
        batch.counts.append(rows)
        batch.offsets.append(0)
        batch.requests.append(None)
        batch.rows = rows
        return batch

    cdef void _add(self, Request r, Py_ssize_t start, Py_ssize_t count):
        self.pieces.append(r.arrays)
        self.starts.append(start)
        self.counts.append(count)
        self.offsets.append(self.rows)
        self.requests.append(r)
        self.rows += count

    def __len__(self):
        return len(self.requests)


cdef class BatchQueue:
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

    def __cinit__(self):
        self._heads = NULL
        self._lane_rows = NULL

    def __init__(self, Py_ssize_t max_queued_rows=0, InputHandler handler=None,
                 policy=None, create_future=None, Py_ssize_t lanes=1, Py_ssize_t levels=1):
        cdef Py_ssize_t k
        if lanes < 1:
            raise ValueError(f"a queue needs at least 1 lane, got {lanes}")
        if levels < 1:
            raise ValueError(f"a queue needs at least 1 priority level, got {levels}")
        self.lanes = lanes
        self.levels = levels
        self.default_level = levels
        self.aging = INFINITY
        self._items = [[] for _ in range(lanes * levels)]
        PyMem_Free(self._heads)
        PyMem_Free(self._lane_rows)
        self._heads = <Py_ssize_t*>PyMem_Malloc(lanes * levels * sizeof(Py_ssize_t))
        self._lane_rows = <Py_ssize_t*>PyMem_Malloc(lanes * sizeof(Py_ssize_t))
        if self._heads == NULL or self._lane_rows == NULL:
            raise MemoryError()
        for k in range(lanes * levels):
            self._heads[k] = 0
        for k in range(lanes):
            self._lane_rows[k] = 0
        self.queued_rows = 0
        self.max_queued_rows = max_queued_rows if max_queued_rows > 0 else _NEVER
        self.earliest_deadline = INFINITY
        self.refused_rows = 0
        self._handler = handler
        self._policy = policy
        self._create_future = create_future
        self._kick = policy.kick if policy is not None else None
        self.default_timeout = INFINITY
        self.kick_rows = 1 if policy is not None else _NEVER
        self.sweep_at = INFINITY
        self.closed = False

    def __dealloc__(self):
        PyMem_Free(self._waits.values)
        PyMem_Free(self._latencies.values)
        PyMem_Free(self._heads)
        PyMem_Free(self._lane_rows)

    def __len__(self):
        cdef Py_ssize_t k, n = 0
        for k in range(self.lanes * self.levels):
            n += PyList_GET_SIZE(<list>self._items[k]) - self._heads[k]
        return n

    @property
    def oldest(self):
        """When the oldest request still waiting was queued (+inf: none waits)."""
        cdef Py_ssize_t k
        cdef double t, oldest = INFINITY
        for k in range(self.lanes):
            t = self._lane_oldest(k)
            if t < oldest:
                oldest = t
        return oldest

    cdef double _lane_oldest(self, Py_ssize_t lane):
        cdef Py_ssize_t i, q
        cdef Request r
        cdef list items
        cdef double oldest = INFINITY
        for q in range(lane * self.levels, (lane + 1) * self.levels):
            items = <list>self._items[q]
            for i in range(self._heads[q], PyList_GET_SIZE(items)):
                r = <Request>items[i]
                if not r.finished:
                    if r.t_enqueue < oldest:
                        oldest = r.t_enqueue
                    break
        return oldest

    def lane_rows(self, Py_ssize_t lane):
        """Rows waiting in ``lane``."""
        if not 0 <= lane < self.lanes:
            raise IndexError(f"lane {lane} of {self.lanes}")
        return self._lane_rows[lane]

    def lane_stats(self, Py_ssize_t lane, Py_ssize_t max_rows, double now):
        """``(rows, requests, age_sum, oldest)`` of the first ``max_rows`` rows waiting
        in ``lane``: what a batch taken from it now would hold (a request counted whole
        if any of its rows would go), the sum of their waits so far (s), and when the
        oldest of them was queued (+inf: none)."""
        cdef Py_ssize_t i, q, rows = 0, n = 0, left
        cdef double ages = 0.0, oldest = INFINITY
        cdef Request r
        cdef list items
        if not 0 <= lane < self.lanes:
            raise IndexError(f"lane {lane} of {self.lanes}")
        for q in range(lane * self.levels, (lane + 1) * self.levels):  # (priority order)
            items = <list>self._items[q]
            for i in range(self._heads[q], PyList_GET_SIZE(items)):
                if rows >= max_rows:
                    break
                r = <Request>items[i]
                if r.finished:
                    continue
                left = r.rows - r.next_row
                rows += left if left < max_rows - rows else max_rows - rows
                n += 1
                ages += now - r.t_enqueue
                if r.t_enqueue < oldest:
                    oldest = r.t_enqueue
        return rows, n, ages, oldest

    @property
    def timings_pending(self):
        """Waits and latencies logged and not drained yet."""
        return self._waits.n + self._latencies.n

    def drain_waits(self):
        """The queue waits (s) logged since the last drain, as a float64 array."""
        return _drain(&self._waits)

    def drain_latencies(self):
        """The request latencies (s) logged since the last drain, as a float64 array."""
        return _drain(&self._latencies)

    # ------------------------------------------------------------------ accepting

    cdef Py_ssize_t _level(self, object priority) except -1:
        # (an object: a priority past Py_ssize_t is refused here by name, not an
        # OverflowError at the call)
        if priority == 0:
            return self.default_level
        if not 1 <= priority <= self.levels:
            raise ValueError(
                f"priority {priority!r} is not a level of this model: 1 (the highest) to "
                f"{self.levels}, or 0 for its default ({self.default_level})"
            )
        return priority

    cdef Request _push(self, tuple arrays, Py_ssize_t rows, object future, double now,
                       double deadline, Py_ssize_t lane, Py_ssize_t level):
        cdef Request r
        if not 0 <= lane < self.lanes:
            raise IndexError(f"lane {lane} of {self.lanes}")
        if rows < 1:
            raise ValueError(f"a request needs at least 1 row, got {rows}")
        if self.queued_rows + rows > self.max_queued_rows:
            self.sweep(now)
            if self.queued_rows + rows > self.max_queued_rows:
                self.refused_rows = rows
                return None
        r = Request.__new__(Request)
        r.arrays = arrays
        r.rows = rows
        r.future = future
        r.t_enqueue = now
        r.deadline = deadline
        r.lane = lane
        r.level = level
        (<list>self._items[lane * self.levels + level - 1]).append(r)
        self.queued_rows += rows
        self._lane_rows[lane] += rows
        if deadline < self.earliest_deadline:
            self.earliest_deadline = deadline
        return r

    cpdef Request push(self, tuple arrays, Py_ssize_t rows, object future=None,
                       double deadline=INFINITY, Py_ssize_t lane=0, object priority=0):
        """Queue a prepared request (``InputHandler.prepare``'s arrays and rows) in
        ``lane`` at level ``priority`` (0: the default); None when its rows do not fit
        under ``max_queued_rows`` (requests whose callers gave up are dropped first, so
        they never hold room)."""
        cdef Py_ssize_t level = self._level(priority)
        return self._push(arrays, rows, future, _clock(), deadline, lane, level)

    cpdef Request submit(self, object request, object timeout=None, object priority=0):
        """Admit one request for serving: validate it, give it a future and a deadline
        ``timeout`` seconds from now (None: ``default_timeout``) and its priority level
        (``priority``; 0: ``default_level``), queue it, and kick the policy when
        ``kick_rows`` rows wait. Raises the handler's TypeError/ValueError for a
        malformed request (ValueError for a priority that is no level), and the policy's
        errors when closed or refused."""
        cdef Py_ssize_t rows = 0, lane = 0, level = self.default_level
        cdef tuple arrays
        cdef double now, deadline
        cdef Request r
        cdef object error
        if self._handler is None or self._policy is None or self._create_future is None:
            raise RuntimeError("submit needs a queue made with a handler, a policy and "
                               "create_future")
        if self.closed:
            raise self._policy.closed_error()
        try:
            if priority:
                level = self._level(priority)
            arrays = self._handler.prepare_c(request, &rows)
            if self.lanes > 1:
                lane = self._handler.lane_c(arrays)
        except (TypeError, ValueError):
            self.invalid += 1
            raise
        now = _clock()
        deadline = now + (self.default_timeout if timeout is None else <double>timeout)
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
            self._kick()
        if deadline < self.sweep_at:
            self.sweep_at = deadline
            self._policy.arm_sweep(deadline)
        return r

    # ------------------------------------------------------------------ batching

    cdef bint _drop_if_gone(self, Request r, double now) except -1:
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

    cpdef Batch take(self, Py_ssize_t max_rows, double now, Py_ssize_t lane=0,
                     object fold=None):
        """The next batch from ``lane``: its waiting requests in order, up to
        ``max_rows`` rows, then, while room is left, whole requests from the lanes in
        ``fold`` (in that order: lanes whose lengths fit this one's); None when nothing
        was taken. A request of ``lane`` that does not fit whole gives the rows that fit
        and then waits behind the requests queued after it for its next piece."""
        cdef Batch batch = None
        cdef Py_ssize_t room = max_rows, k
        if not 0 <= lane < self.lanes:
            raise IndexError(f"lane {lane} of {self.lanes}")
        batch = self._take_lane(batch, lane, &room, now, True)
        if fold is not None:
            for k in fold:
                if room <= 0:
                    break
                if not 0 <= k < self.lanes:
                    raise IndexError(f"lane {k} of {self.lanes}")
                batch = self._take_lane(batch, k, &room, now, False)
        if batch is not None:
            batch.lane = lane
        if self.queued_rows == 0:
            self.earliest_deadline = INFINITY
        return batch

    cdef Batch _take_lane(self, Batch batch, Py_ssize_t lane, Py_ssize_t* room, double now,
                          bint split):
        cdef Py_ssize_t q, before
        cdef bint aged = False
        if self.levels == 1:
            return self._take_fifo(batch, lane, lane, room, now, split, _NEVER)
        while room[0] > 0:  # by priority: the highest level's requests, aged ones first
            q = self._next_fifo(lane, now, &aged)
            if q < 0:
                break
            before = room[0]
            # With no aged request in the lane, the level's requests go in one run.
            batch = self._take_fifo(batch, q, lane, room, now, split, 1 if aged else _NEVER)
            if room[0] == before:
                break  # (its next request does not fit)
        return batch

    cdef Py_ssize_t _next_fifo(self, Py_ssize_t lane, double now, bint* aged_out) except -2:
        # The FIFO of ``lane`` to take from next: the oldest head that has waited
        # ``aging``, else the highest level's (-1 when none waits); and whether any head
        # has aged (``aged_out``).
        cdef Py_ssize_t q, head, n, first = -1, aged = -1
        cdef double t, aged_at = INFINITY
        cdef list items
        for q in range(lane * self.levels, (lane + 1) * self.levels):
            items = <list>self._items[q]
            head = self._heads[q]
            n = PyList_GET_SIZE(items)
            while head < n and self._drop_if_gone(<Request>items[head], now):
                items[head] = None
                head += 1
            self._heads[q] = head
            if head == n:
                continue
            t = (<Request>items[head]).t_enqueue
            if first < 0:
                first = q
            if now - t >= self.aging and t < aged_at:
                aged = q
                aged_at = t
        aged_out[0] = aged >= 0
        return aged if aged >= 0 else first

    cdef Batch _take_fifo(self, Batch batch, Py_ssize_t q, Py_ssize_t lane, Py_ssize_t* room,
                          double now, bint split, Py_ssize_t most):
        # Up to ``most`` requests (or the rows that fit) of FIFO ``q`` of ``lane``.
        cdef Request r
        cdef Py_ssize_t left, n, head = self._heads[q]
        cdef list items = <list>self._items[q]
        n = PyList_GET_SIZE(items)
        while head < n and room[0] > 0 and most > 0:
            r = <Request>items[head]
            if self._drop_if_gone(r, now):
                items[head] = None
                head += 1
                continue
            left = r.rows - r.next_row
            if left > room[0]:
                if not split:
                    break
                left = room[0]
            if batch is None:
                batch = Batch.__new__(Batch)
            if r.next_row == 0:
                _log(&self._waits, now - r.t_enqueue)
            batch._add(r, r.next_row, left)
            r.next_row += left
            room[0] -= left
            self.queued_rows -= left
            self._lane_rows[lane] -= left
            most -= 1
            if r.next_row == r.rows:
                items[head] = None  # the batch holds it now
                head += 1
        if split and room[0] == 0 and head < n - 1 and (<Request>items[head]).next_row:
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
        return batch

    # ------------------------------------------------------------------ answering

    cdef int _finish(self, Request r, object result, object error) except -1:
        # Answer r; 1 if this answered it, 0 if it was answered (or given up) before.
        if r.finished:
            return 0
        r.finished = True
        r.parts = None
        if r.next_row < r.rows:  # rows still waiting leave the queue with it
            if not 0 <= r.lane < self.lanes:
                raise ValueError("the request is not from this queue")
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

    cpdef Py_ssize_t deliver(self, Batch batch, bint copy=False, double now=-1.0) except -1:
        """Answer the requests of a batch whose ``outputs`` came back: each whole request
        gets its outputs, a split one once all its pieces are in. Logs each answered
        request's latency up to ``now`` (default: the clock); returns how many."""
        cdef Py_ssize_t i, count, answered = 0
        cdef Request r
        cdef list requests = batch.requests
        cdef list outputs = batch.outputs
        cdef list counts = batch.counts
        cdef object out
        if len(outputs) != len(requests):
            raise ValueError(f"{len(outputs)} outputs for a batch of {len(requests)} pieces")
        if now < 0:
            now = _clock()
        for i in range(PyList_GET_SIZE(requests)):
            r = <Request>requests[i]
            if r.finished:
                continue
            count = counts[i]
            out = outputs[i]
            if count != r.rows:
                if r.parts is None:
                    r.parts = []
                r.parts.append((batch.starts[i], out))
                r.rows_done += count
                if r.rows_done < r.rows:
                    continue
                out = join_pieces(r.parts, copy)
            if self._finish(r, out, None):
                answered += 1
                _log(&self._latencies, now - r.t_enqueue)
        return answered

    cpdef Py_ssize_t fail(self, Batch batch, object error) except -1:
        """Answer every request of a failed batch with ``error`` (a split request
        fails whole); returns how many were answered."""
        cdef Py_ssize_t answered = 0
        cdef Request r
        for r in batch.requests:
            answered += self._finish(r, None, error)
        return answered

    cpdef bint cancel(self, Request r):
        """Its caller gave up: rows not yet in a batch leave the queue, rows in one
        still run and their outputs are dropped. False if it was answered already."""
        if r.finished:
            return False
        if not 0 <= r.lane < self.lanes:
            raise ValueError("the request is not from this queue")
        r.finished = True
        r.parts = None
        self.queued_rows -= r.rows - r.next_row
        self._lane_rows[r.lane] -= r.rows - r.next_row
        r.next_row = r.rows
        self.cancelled += 1
        return True

    cpdef double sweep(self, double now) except? -1:
        """Answer the waiting requests whose deadline passed, drop the ones whose callers
        gave up; returns the earliest deadline among those still waiting (+inf)."""
        cdef Request r
        cdef list keep, items
        cdef double earliest = INFINITY
        cdef Py_ssize_t i, k
        for k in range(self.lanes * self.levels):
            items = <list>self._items[k]
            keep = []
            for i in range(self._heads[k], PyList_GET_SIZE(items)):
                r = <Request>items[i]
                if self._drop_if_gone(r, now):
                    continue
                keep.append(r)
                if r.next_row == 0 and r.deadline < earliest:
                    earliest = r.deadline
            self._items[k] = keep
            self._heads[k] = 0
        self.earliest_deadline = earliest
        return earliest
