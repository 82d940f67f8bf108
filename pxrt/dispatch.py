"""The execution engine: from prepared requests to per-request outputs.

One ``Engine`` per loaded model owns its compiled buckets and the handlers, and runs a
``Batch`` (planned by a ``BatchQueue``: requests packed in order, oversize ones split)
through assemble -> put -> execute -> fetch -> split. ``Engine.run`` does that on the
calling thread; ``Engine.pipeline`` starts worker threads that do the same for batches
handed to ``Pipeline.submit``, several in flight. ``Model.run``/``run_batch`` and the
serving layer both drive this one engine; nothing else touches programs or rings.

No asyncio here: the serving layer brings its event loop.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from . import _ext, _xla
from .contracts import InputHandling, QueuePolicy, ResultHandling

log = logging.getLogger("pxrt")

Batch = _ext.Batch
BatchQueue = _ext.BatchQueue
Request = _ext.Request

_clock = time.perf_counter


class Program(Protocol):
    """One compiled bucket, runnable on a staging slot (see ``pxrt._xla``).

    ``dispatch`` starts the execution on the slot's buffers and returns a handle;
    ``fetch`` waits for it and returns, per output, its per-device shards in row order,
    ``out_shard_rows`` rows each. ``row_slices`` are the batch rows each device takes,
    in the order ``dispatch`` puts them.
    """

    @property
    def path(self) -> str:
        """How it runs: ``"public"`` (jax's API), or a fast path verified at load
        against it: ``"raw"`` or ``"call"``."""
        ...

    @property
    def row_slices(self) -> Sequence[slice]: ...

    @property
    def out_shard_rows(self) -> int: ...

    def dispatch(self, slot: _xla.StagingSlot) -> Any: ...

    def fetch(self, handle: Any) -> list[list[np.ndarray]]: ...


class StagingRing:
    """Reusable staging slots for one bucket.

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


@dataclasses.dataclass(eq=False, slots=True)
class Bucket:
    """One compiled cell: a batch size (and, for named dimensions, their lengths), its
    program, its staging ring, and what load measured (seconds to get its executable;
    seconds per execution, from back-to-back runs: only ``Model.remeasure`` changes
    them after load)."""

    size: int
    program: Program
    ring: StagingRing
    compiled: Any  # the jax.stages.Compiled behind the program
    compile_s: float
    exec_s: float
    lengths: tuple[int, ...] = ()  # per named dimension, in the model's order
    #: Where its executable came from: "compiled", "cache" (jax's persistent cache) or
    #: "stored" (pxrt's stored executable).
    source: str = "compiled"
    #: Where ``exec_s`` came from: "measured" by this load (or since), or "stored" by an
    #: earlier one (``Model.remeasure`` refreshes it).
    timed: str = "measured"
    #: Per instance of a model loaded as several (``pxrt.load(placement="replicated")``):
    #: its program and staging ring, each on its own devices. ``program`` and ``ring``
    #: are the first instance's; empty means that one only.
    programs: tuple[Program, ...] = ()
    rings: tuple[StagingRing, ...] = ()

    def __post_init__(self) -> None:
        if not self.programs:
            self.programs = (self.program,)
            self.rings = (self.ring,)

    @property
    def fast_path(self) -> bool:
        """It runs on a fast path (``program.path`` is not ``"public"``)."""
        return self.program.path != "public"


def lane_key(lengths: tuple[int, ...]) -> tuple:
    """How lanes are ordered: by the elements of one example (cheapest first)."""
    return (int(np.prod(lengths, dtype=np.int64)), lengths)


def lane_table(
    lanes: Sequence[tuple[int, ...]],
) -> tuple[list[tuple[int, ...]], list[int]]:
    """For lanes (each a tuple of lengths, one per named dimension, in ``lane_key``
    order): per dimension its sorted lengths, and the table an ``InputHandler`` maps
    a request's lengths with: the product of per-dimension length indices (row-major)
    -> the cheapest lane that holds them (-1: none)."""
    if not lanes or not lanes[0]:
        return [], [0]
    per_dim = [sorted({lane[d] for lane in lanes}) for d in range(len(lanes[0]))]
    table = []
    for cell in itertools.product(*per_dim):
        fits = [i for i, lane in enumerate(lanes) if all(c <= v for c, v in zip(cell, lane))]
        table.append(fits[0] if fits else -1)
    return [tuple(v) for v in per_dim], table


class Lane:
    """The buckets of one set of lengths (all of them, for a model without named
    dimensions): batch sizes -> compiled buckets."""

    def __init__(self, index: int, lengths: tuple[int, ...], buckets: Sequence[Bucket]) -> None:
        self.index = index
        self.lengths = lengths
        self.buckets: tuple[Bucket, ...] = tuple(sorted(buckets, key=lambda b: b.size))
        self.sizes: tuple[int, ...] = tuple(b.size for b in self.buckets)
        self.max_rows: int = self.sizes[-1]
        # rows -> the bucket a batch of that many rows runs in, for 0 < rows <= max_rows.
        self._by_rows: list[Bucket] = [self.buckets[0]] + [
            self.buckets[bisect.bisect_left(self.sizes, n)] for n in range(1, self.max_rows + 1)
        ]

    def bucket_for(self, rows: int) -> Bucket:
        return self._by_rows[rows]

    def __repr__(self) -> str:
        return f"Lane({self.index}, lengths={self.lengths}, sizes={self.sizes})"


class Engine:
    """Runs batches of one model's requests in its compiled buckets. Thread-safe.

    Args:
      name: the model name (thread names, error messages).
      input_handler, result_handler: the model's ``InputHandler``/``ResultHandler``.
      buckets: the compiled buckets, any order.
      owner: what compiles on this engine's request path are counted against
        (``pxrt._xla.compile_counter``); the Model.
    """

    def __init__(
        self,
        name: str,
        input_handler: InputHandling,
        result_handler: ResultHandling,
        buckets: Sequence[Bucket],
        owner: object,
    ) -> None:
        if not buckets:
            raise ValueError("an engine needs at least one bucket")
        self.name = name
        self.input_handler = input_handler
        self.result_handler = result_handler
        self.owner = owner
        self.dim_names: tuple[str, ...] = tuple(input_handler.dim_names)
        by_lengths: dict[tuple[int, ...], list[Bucket]] = {}
        for b in buckets:
            by_lengths.setdefault(tuple(b.lengths), []).append(b)
        #: One lane per set of lengths, cheapest first (one lane without named dims).
        self.lanes: tuple[Lane, ...] = tuple(
            Lane(i, lengths, by_lengths[lengths])
            for i, lengths in enumerate(sorted(by_lengths, key=lane_key))
        )
        self.buckets: tuple[Bucket, ...] = tuple(b for lane in self.lanes for b in lane.buckets)
        self.sizes: tuple[int, ...] = tuple(sorted({b.size for b in self.buckets}))
        self.max_rows: int = max(lane.max_rows for lane in self.lanes)
        #: Per lane: the other lanes whose requests fit its lengths, nearest first.
        self.fold_lanes: tuple[tuple[int, ...], ...] = tuple(
            tuple(
                other.index
                for other in reversed(self.lanes[: lane.index])
                if all(a <= b for a, b in zip(other.lengths, lane.lengths))
            )
            for lane in self.lanes
        )
        self.prepare = input_handler.prepare
        self.lane_of = input_handler.lane_of
        #: Instances of the model (each bucket has a program per instance).
        self.instances: int = len(self.buckets[0].programs)
        if any(len(b.programs) != self.instances for b in self.buckets):
            raise ValueError("every bucket needs a program per instance")
        #: Per instance: seconds of work handed to it and not yet done (by the buckets'
        #: measured times), and batches run so far.
        self.instance_work = [0.0] * self.instances
        self.instance_batches = [0] * self.instances
        self._instance_lock = threading.Lock()
        self._next_instance = 0

    def bucket_for(self, rows: int, lane: int = 0) -> Bucket:
        """The bucket a batch of ``rows`` rows runs in in ``lane``: the smallest that
        holds it."""
        the_lane = self.lanes[lane]
        if not 0 < rows <= the_lane.max_rows:
            raise ValueError(
                f"a batch of {rows} rows fits no bucket of model {self.name!r} "
                f"(buckets {list(the_lane.sizes)})"
            )
        return the_lane.bucket_for(rows)

    def replace_programs(self, wrap: Callable[[Program], Program]) -> Engine:
        """A new engine whose buckets run ``wrap(program)`` instead (same rings and
        handlers; every instance's): for tracing, fault injection and tests."""
        buckets = []
        for b in self.buckets:
            programs = tuple(wrap(p) for p in b.programs)
            buckets.append(dataclasses.replace(b, program=programs[0], programs=programs))
        return Engine(self.name, self.input_handler, self.result_handler, buckets, self.owner)

    # ------------------------------------------------------------------ instances

    def _pick(self, cost: float) -> int:
        """The instance that will finish a batch of ``cost`` seconds first: the least
        outstanding work (ties: the next in turn). Its work grows by ``cost`` until
        ``_done``."""
        with self._instance_lock:
            work = self.instance_work
            n = len(work)
            start = self._next_instance
            best = min(range(start, start + n), key=lambda k: work[k % n]) % n
            self._next_instance = (best + 1) % n
            work[best] += cost
            self.instance_batches[best] += 1
            return best

    def _done(self, instance: int, cost: float) -> None:
        with self._instance_lock:
            self.instance_work[instance] = max(0.0, self.instance_work[instance] - cost)

    def queue(
        self,
        max_queued_rows: int = 0,
        policy: QueuePolicy | None = None,
        create_future: Callable[[], Any] | None = None,
        levels: int = 1,
    ) -> BatchQueue:
        """A new, empty queue to plan this engine's batches with (``levels``: priority
        levels); its ``submit`` validates requests with this engine's input handler (see
        ``BatchQueue``)."""
        return BatchQueue(
            max_queued_rows, self.input_handler, policy, create_future, len(self.lanes), levels
        )

    # ------------------------------------------------------------------ running

    def run(self, batch: Batch, copy: bool = False) -> None:
        """Run ``batch`` on the calling thread: fills ``batch.bucket``, the stage clocks
        and ``batch.outputs`` (per piece, output name -> rows), or raises."""
        bucket = self.bucket_for(batch.rows, batch.lane)
        batch.bucket = bucket
        if self.instances == 1:
            instance = -1
            program, ring = bucket.program, bucket.ring
        else:
            instance = self._pick(bucket.exec_s)
            program, ring = bucket.programs[instance], bucket.rings[instance]
        slot = ring.acquire()
        try:
            batch.t_start = _clock()
            self.input_handler.assemble(batch.pieces, batch.starts, batch.counts, slot.buffers)
            handle = program.dispatch(slot)
            batch.t_dispatched = _clock()
            shards = program.fetch(handle)
            batch.t_fetched = _clock()
        finally:
            # The outputs are on the host: the slot's device buffers are done with it.
            handle = None
            ring.release(slot)
            if instance >= 0:
                self._done(instance, bucket.exec_s)
        lengths = None
        if self.dim_names:
            lengths_of = self.input_handler.lengths_of
            lengths = [lengths_of(piece) for piece in batch.pieces]
            valid = sum(c * math.prod(ls) for c, ls in zip(batch.counts, lengths))
            batch.fill = valid / (bucket.size * math.prod(bucket.lengths))
        else:
            batch.fill = batch.rows / bucket.size
        batch.outputs = self.result_handler.split(
            shards, program.out_shard_rows, batch.offsets, batch.counts, copy, lengths
        )
        batch.t_done = _clock()

    def run_one(self, arrays: tuple, rows: int, copy: bool = False) -> dict[str, np.ndarray]:
        """One prepared request (``prepare``'s arrays and rows), split across executions
        if it is larger than the largest bucket."""
        lane = self.lane_of(arrays)
        if rows <= self.lanes[lane].max_rows:
            batch = Batch.single(arrays, rows, lane)
            self.run(batch, copy)
            assert batch.outputs is not None  # run fills them or raises
            return batch.outputs[0]
        return self.run_all([(arrays, rows)], copy, False)[0]

    def run_all(self, prepared: Sequence[tuple], copy: bool, return_exceptions: bool) -> list:
        """Prepared requests ``(arrays, rows)`` in as few executions as the buckets allow.
        Returns one output dict per request, in order; a failed execution raises, or with
        ``return_exceptions`` becomes the entry of each request it held."""
        plan = BatchQueue(lanes=len(self.lanes))
        requests: list[Any] = []
        for arrays, rows in prepared:
            try:  # a partial grid may have no cell for these lengths
                lane = self.lane_of(arrays) if self.dim_names else 0
            except ValueError as exc:
                if not return_exceptions:
                    raise
                requests.append(exc)
                continue
            requests.append(plan.push(arrays, rows, lane=lane))
        for each in self.lanes:
            while (batch := plan.take(each.max_rows, 0.0, each.index)) is not None:
                try:
                    self.run(batch, copy)
                except Exception as exc:
                    if not return_exceptions:
                        raise
                    plan.fail(batch, exc)
                    continue
                plan.deliver(batch, copy)
        return [
            r if isinstance(r, Exception) else r.result if r.error is None else r.error
            for r in requests
        ]

    def pipeline(
        self,
        on_done: Callable[[Batch], None],
        *,
        workers: int = 2,
        copy: bool = False,
        name: str = "",
    ) -> Pipeline:
        """Start ``workers`` threads that run submitted batches (see ``Pipeline``)."""
        return Pipeline(self, on_done, workers=workers, copy=copy, name=name or self.name)


_STOP = object()


class Pipeline:
    """Worker threads that run batches through ``Engine.run``, several in flight: while
    one worker waits for its batch's execution, another assembles and dispatches the
    next. Each batch goes end to end on one thread: one hand-off in, one out.

    ``on_done(batch)`` is called on the worker thread once per batch, with
    ``batch.outputs`` or ``batch.error`` set. A failing batch fails alone. Work on these
    threads counts as the engine owner's request path for the compile counter.
    """

    def __init__(
        self,
        engine: Engine,
        on_done: Callable[[Batch], None],
        *,
        workers: int = 2,
        copy: bool = False,
        name: str = "",
    ) -> None:
        if workers < 1:
            raise ValueError(f"a pipeline needs at least 1 worker, got {workers}")
        self.engine = engine
        self._on_done = on_done
        self._copy = copy
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"pxrt-{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, batch: Batch) -> None:
        """Queue a batch for the workers; never blocks."""
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        self._todo.put(batch)

    def check_alive(self) -> None:
        """Raise RuntimeError unless the pipeline is open and every worker runs."""
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead:
            raise RuntimeError(f"pipeline worker threads died: {', '.join(dead)}")

    def close(self) -> None:
        """Finish every submitted batch, then stop the workers (blocks until they end)."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._todo.put(_STOP)
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        run, copy, on_done, todo = self.engine.run, self._copy, self._on_done, self._todo
        with _xla.compile_counter.request_path(self.engine.owner):
            while (batch := todo.get()) is not _STOP:
                try:
                    run(batch, copy)
                except BaseException as exc:  # noqa: BLE001 - the batch's callers get it
                    batch.error = exc
                try:
                    on_done(batch)
                except BaseException:  # noqa: BLE001 - a broken callback must not stop us
                    log.exception("pxrt: the on_done callback of a batch raised")
                # Not kept while idle: its outputs pin device buffers.
                batch = None  # noqa: F841
