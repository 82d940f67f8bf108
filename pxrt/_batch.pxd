# Batch plans: the C-level API of pxrt/_batch.pyx.

from pxrt._handlers cimport InputHandler


cdef class Request:
    cdef readonly tuple arrays          # the prepared inputs, in model input order
    cdef readonly Py_ssize_t rows
    cdef readonly object future         # the caller's future, or None (synchronous plans)
    cdef readonly double t_enqueue      # perf_counter when it was queued
    cdef readonly double deadline       # perf_counter deadline; +inf: none
    cdef readonly Py_ssize_t lane       # the lane (compiled lengths) it waits in
    cdef readonly Py_ssize_t level      # its priority level: 1 goes first
    cdef readonly Py_ssize_t next_row   # rows [0, next_row) went into batches
    cdef Py_ssize_t rows_done           # rows whose outputs came back (split requests)
    cdef list parts                     # (start, outputs) of a split request's pieces
    cdef readonly bint finished         # answered (result, error, expired or cancelled)
    cdef readonly object result         # without a future: the outputs
    cdef readonly object error          # without a future: the error
    cdef object _steps                  # the future's iterator, when driven as a coroutine


cdef class Batch:
    cdef readonly list pieces           # per piece: its request's arrays
    cdef readonly list starts           # per piece: first row taken from its request
    cdef readonly list counts           # per piece: rows taken
    cdef readonly list offsets          # per piece: first row in the batch
    cdef readonly list requests         # per piece: its Request
    cdef readonly Py_ssize_t rows
    cdef public Py_ssize_t lane         # the lane it runs in (its pieces' lengths fit it)
    cdef public object bucket
    cdef public object outputs          # per piece: output name -> array
    cdef public object error
    cdef public double fill             # valid elements / elements the cell computes
    cdef public double t_start, t_dispatched, t_fetched, t_done

    cdef void _add(self, Request r, Py_ssize_t start, Py_ssize_t count)


# A growable log of durations (seconds), drained by the metrics.
ctypedef struct TimeLog:
    double* values
    Py_ssize_t n
    Py_ssize_t cap


cdef class BatchQueue:
    # One FIFO per lane and priority level: FIFO q = lane * levels + level - 1 is
    # _items[q][_heads[q]:]; lane k holds _lane_rows[k] rows over its levels.
    cdef readonly Py_ssize_t lanes
    cdef readonly Py_ssize_t levels
    cdef public Py_ssize_t default_level  # the level of a request that names none
    cdef public double aging            # a request waiting this long (s) goes first
    cdef list _items
    cdef Py_ssize_t* _heads
    cdef Py_ssize_t* _lane_rows
    cdef readonly Py_ssize_t queued_rows
    cdef readonly Py_ssize_t max_queued_rows
    cdef readonly double earliest_deadline
    cdef readonly Py_ssize_t refused_rows  # the rows of the last request refused
    # Outcomes decided here, counted since the queue was made.
    cdef readonly Py_ssize_t invalid, rejected, expired, cancelled
    # Serving: submit makes futures, and tells the policy when a batch could go.
    cdef InputHandler _handler
    cdef object _policy
    cdef object _create_future
    cdef object _kick
    cdef public double default_timeout
    cdef public Py_ssize_t kick_rows    # submit calls policy.kick() once this many rows wait
    cdef public double sweep_at         # submit calls policy.arm_sweep(d) for a deadline d < this
    cdef public bint closed             # submit refuses with policy.closed_error()
    cdef TimeLog _waits                 # per request: queued -> taken into a batch
    cdef TimeLog _latencies             # per request: queued -> answered

    cdef Py_ssize_t _level(self, object priority) except -1
    cdef Request _push(self, tuple arrays, Py_ssize_t rows, object future, double now,
                       double deadline, Py_ssize_t lane, Py_ssize_t level)
    cpdef Request push(self, tuple arrays, Py_ssize_t rows, object future=*,
                       double deadline=*, Py_ssize_t lane=*, object priority=*)
    cpdef Request submit(self, object request, object timeout=*, object priority=*)
    cpdef Batch take(self, Py_ssize_t max_rows, double now, Py_ssize_t lane=*, object fold=*)
    cdef Batch _take_lane(self, Batch batch, Py_ssize_t lane, Py_ssize_t* room, double now,
                          bint split)
    cdef Py_ssize_t _next_fifo(self, Py_ssize_t lane, double now, bint* aged) except -2
    cdef Batch _take_fifo(self, Batch batch, Py_ssize_t q, Py_ssize_t lane, Py_ssize_t* room,
                          double now, bint split, Py_ssize_t most)
    cpdef Py_ssize_t deliver(self, Batch batch, bint copy=*, double now=*) except -1
    cpdef Py_ssize_t fail(self, Batch batch, object error) except -1
    cpdef bint cancel(self, Request r)
    cpdef double sweep(self, double now) except? -1
    cdef double _lane_oldest(self, Py_ssize_t lane)
    cdef bint _drop_if_gone(self, Request r, double now) except -1
    cdef int _finish(self, Request r, object result, object error) except -1
