"""Prefill beside the steps (``pxrt.load(overlap_prefill=True)``, the default on CPU
devices): a prompt's prefill reads nothing of the decoder's state, so it runs on a
thread of its own (one per decoder) while the loop steps the running streams; the loop
inserts its rows into the slots reserved for it once it is done. On CPU devices two
programs dispatched from two threads run at once, so a long prompt no longer stalls
every stream for its whole prefill (one program at a time runs on an accelerator: there
the fused prefill-and-insert stays). A part of ``pxrt.decoder.engine.Decoder`` (a
mixin, like ``pxrt.decoder.scheduler``).

The order, for the prompts of one prefill (a "unit"): admission reserves their slots
(``Generation.reserved``) and hands the unit to the thread; the thread runs the rows
program and waits for it; the loop, at the start of its next turn, writes the sampling
controls and dispatches the insert (which samples the first tokens), after which the
slots are busy and step with the others. A generation cancelled meanwhile gives its
slot back only then (its row of the insert is dropped): the slot is never reused while
its rows are in flight.

With every slot taken, the prompts at the head of the queue are prefilled ahead of a
free slot (``Scheduler._prefills_ahead``, up to the largest prefill batch a unit): no
slot is reserved (``reserved`` stays -1), and each prompt's row is inserted into the
lowest free slot at the start of the first turn that has one (``_insertable``; with
length tiers, a row of the shortest tier with one free that holds it), before that
turn admits others, so a stream that ends is followed by the next at once instead of
after a prefill. A unit's rows go in as slots free, a few at a time (``Unit.left``:
the rows not inserted yet; the others' rows of the insert are dropped), so that a unit
of four never waits for four free slots at once.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .. import _xla, sampling
from .placement import Placement
from .scheduler import row_order

if TYPE_CHECKING:
    from .core import Core
    from .request import Generation
    from .runner import PrefillCell
else:
    Core = object


@dataclasses.dataclass(eq=False)
class Unit:
    """One prefill on the prefill thread: its cell, its host arrays (the slots in the
    ints' SLOT column), its generations (row i: ``batch[i]``) and when it was admitted;
    the thread fills in its rows and logits, or its error."""

    cell: PrefillCell
    tokens: np.ndarray
    ints: np.ndarray
    floats: np.ndarray
    batch: list[Generation]
    t0: float
    rows: Any = None
    logits: Any = None
    error: BaseException | None = None
    #: When the thread had its rows (``time.perf_counter``).
    done: float = 0.0
    #: The rows not inserted yet (indices into ``batch``): a unit prefilled ahead of
    #: free slots goes in as they free, a few rows at a time.
    left: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.left = list(range(len(self.batch)))


class Overlap(Core):
    """The prefill thread, and inserting what it prefilled."""

    # (what this part assigns, as ``pxrt.decoder.core.Core`` declares it)
    _state: Any
    _special: bool
    overlap_prefill: bool
    _prefilling: list[Unit]
    _prefilled: list[Unit]
    _in_prefill: set[Generation]
    _units: queue.SimpleQueue | None
    _prefiller: threading.Thread | None

    def _wire_overlap(self, on: bool, measured: bool = False) -> None:
        #: Whether prefills run on a thread of their own, beside the steps.
        self.overlap_prefill = bool(on)
        # With ``measured``, whether a unit that fits the turn's bound goes there or
        # between two steps is chosen by the tokens/s each way makes as the loop runs.
        self._placement = Placement() if on and measured else None
        self._prefilling = []  # handed to the thread, not inserted (the loop's thread)
        self._prefilled = []  # done by the thread (under ``_cond``)
        self._in_prefill = set()  # their generations
        self._units = None  # the thread's queue, once started
        self._prefiller = None  # the thread

    def _prefill_beside(self, unit: Unit) -> None:
        """Hand ``unit`` (its slots reserved) to the prefill thread."""
        self._prefilling.append(unit)
        self._in_prefill.update(unit.batch)
        if self._units is None:
            self._units = queue.SimpleQueue()
            self._prefiller = threading.Thread(
                target=_prefiller,
                args=(self._units, weakref.ref(self), self._params, self.artifact.x64),
                name=f"pxrt-prefill-{self.name}",
                daemon=True,
            )
            self._prefiller.start()
        self._units.put(unit)

    def _posted(self, unit: Unit) -> None:
        """(the prefill thread) ``unit`` is done: the loop inserts it next turn."""
        with self._cond:
            self._prefilled.append(unit)
            if self._idle:
                self._cond.notify()

    def _insert(self, unit: Unit) -> None:
        """Insert the rows of a prefilled unit that have their slots now: the sampling
        controls written, the first tokens sampled (read like a prefill's); a
        generation cancelled meanwhile gives its slot back now, its row dropped. Rows
        prefilled ahead of free slots with none yet stay for a later turn
        (``Unit.left``); the unit is done when none is left."""
        first = len(unit.left) == len(unit.batch)
        if first and self._placement is not None and unit.done:
            self._placement.rows_done(unit.done - unit.t0)
        ints = unit.ints.copy()
        ints[:, sampling.SLOT] = self.slots  # (out of range: dropped, but the rows below)
        owners: list[Generation | None] = [None] * len(unit.batch)
        done, ended = self._take_rows(unit, ints, owners)
        if not unit.left:
            self._prefilling.remove(unit)
        if unit.error is not None:
            error = RuntimeError(f"decoder {self.name!r}: prefill failed: {unit.error!r}")
            error.__cause__ = unit.error
            self._finish_with(ended, error)
            return
        if not done:
            return
        # (a failure from here fails the state and the generations in its slots: these)
        for gen, slot in done:
            self._write_controls(gen, slot)
        self._save_columns([(i, g) for i, g in enumerate(owners) if g is not None], ints)
        (self._state, first_tokens, scores), _ = self._launch(
            -1, unit.cell.compiled.insert, self._state, unit.rows, unit.logits, ints, unit.floats
        )
        first_tokens.copy_to_host_async()
        self._pending.append((0, first_tokens, owners, unit.t0, self._scores(owners, scores), None))

    def _take_rows(
        self, unit: Unit, ints: np.ndarray, owners: list
    ) -> tuple[list[tuple[Generation, int]], list[Generation]]:
        """Of ``unit``'s rows left, those with a slot now go in (their slot in ``ints``,
        their generation in ``owners`` and the slot table); those cancelled, or of a
        unit that failed, end (their slots back); the rest stay left. Returns the
        (generation, slot) pairs going in and the generations that ended."""
        table = self._table
        done: list[tuple[Generation, int]] = []
        ended: list[Generation] = []
        keep: list[int] = []
        for i in unit.left:
            gen = unit.batch[i]
            slot = gen.reserved
            if gen.finish_reason is None and unit.error is None and slot < 0:
                keep.append(i)  # (prefilled ahead: no slot free for it yet)
                continue
            gen.reserved = -1
            self._in_prefill.discard(gen)
            if gen.finish_reason is not None or unit.error is not None:
                ended.append(gen)
                if slot >= 0:
                    table.free.append(slot)
                continue
            ints[i, sampling.SLOT] = slot
            table.assign(gen, slot)
            owners[i] = gen
            done.append((gen, slot))
            if gen.controls is not None or gen.logprobs is not None:
                self._special = True  # (its steps: the full one, from now on)
        unit.left = keep
        return done, ended

    def _insertable(self, units: list[Unit]) -> list[Unit]:
        """Of the prefilled ``units``, those with rows to insert now, in order: each
        prompt prefilled ahead of free slots given its slot now (the lowest free row;
        with length tiers, a row of the shortest tier with one free that holds it) while
        one is free. A unit with rows still waiting for a slot stays for the next turns
        too (ahead of what the thread posted since: the first free slots are theirs)."""
        now: list[Unit] = []
        later: list[Unit] = []
        free = self._table.free
        for unit in units:  # (a failed unit's rows are dropped: it takes no slot)
            waits = ready = False  # (a row without a slot yet; one to insert or drop)
            for i in unit.left if unit.error is None else ():
                gen = unit.batch[i]
                if gen.reserved < 0 and gen.finish_reason is None:
                    slot = self._ahead_slot(gen)
                    if slot < 0:
                        waits = True
                        continue
                    free.remove(slot)
                    gen.reserved = slot
                ready = True
            if ready or not waits:
                now.append(unit)
            if waits:
                later.append(unit)
        if later:
            with self._cond:
                self._prefilled[:0] = later
        return now

    def _ahead_slot(self, gen: Generation) -> int:
        """The free slot for ``gen``, prefilled ahead of free slots; -1: none yet."""
        free = self._table.free
        if self._slot_length:
            return self._tier_slot(gen, {})
        return min(free, key=row_order(self._rows_per_device)) if free else -1

    def _stop_prefiller(self) -> None:
        """Stop the prefill thread and wait for the program it runs: a process that
        exits while a daemon thread is inside XLA can abort (prompts prefilled ahead of
        free slots keep the thread busier at a server's stop)."""
        if self._units is not None:
            self._units.put(None)
        thread = self._prefiller
        if thread is not None and thread is not threading.current_thread():
            thread.join(60)


def _prefiller(units: queue.SimpleQueue, ref: weakref.ref, params: Any, x64: bool) -> None:
    """A decoder's prefill thread: each unit's rows program, waited for, then posted to
    the loop; until the decoder is closed (a None unit) or dropped."""
    with _xla.x64_scope(x64):
        while True:
            unit = units.get()
            if unit is None:
                return
            try:
                unit.rows, unit.logits = unit.cell.compiled.rows(params, unit.tokens, unit.ints)
                jax.block_until_ready((unit.rows, unit.logits))
                unit.done = time.perf_counter()
            except Exception as exc:  # noqa: BLE001 - its generations fail, not the loop
                unit.error = exc
            decoder = ref()
            if decoder is None:
                return
            decoder._posted(unit)
            del decoder
