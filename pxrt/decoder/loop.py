"""The decoder's loop: one thread per decoder (started on first use), whose turn admits
waiting prompts, dispatches the next step and reads the previous one's tokens (see
``pxrt.decoder.engine``), waking their readers; cancels, failures (a failed program
fails its generations and the loop starts again from a fresh state) and the timings. A
part of ``pxrt.decoder.engine.Decoder`` (a mixin, like ``pxrt.decoder.scheduler``).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from .. import _xla
from ..finish import CANCELLED, ERROR
from .request import wake_async

if TYPE_CHECKING:
    from .core import Core
    from .request import Generation
else:
    Core = object

#: What ``Decoder.drain_timings`` returns durations of (seconds).
TIMINGS = ("step", "prefill", "ttft", "tpot")


class Loop(Core):
    """The loop's thread and turn, waking readers, and failing generations."""

    # (what the loop assigns, as ``pxrt.decoder.core.Core`` declares it)
    _thread: threading.Thread | None
    _cancels: list[Generation]
    _arrivals: list[tuple[Any, BaseException | None, int]]
    _prefilled: list[Any]
    _timings: dict[str, list[float]]

    def _cancel(self, gen: Generation, reason: str) -> None:
        with self._cond:
            if gen.finish_reason is not None:
                return
            gen.finish_reason = reason
            self._cancels.append(gen)
            if self._idle:
                self._cond.notify()
        self._wake([gen])

    def _start(self) -> None:
        _LIVE.add(self)
        self._thread = threading.Thread(
            target=_serve,
            args=(weakref.ref(self), self.artifact.x64),
            name=f"pxrt-generate-{self.name}",
            daemon=True,
        )
        self._thread.start()

    def _has_work(self) -> bool:
        return bool(
            self._arrivals
            or self._prefilled
            or self._cancels
            or self._table.busy
            or self._pending
            or self._waiting
            or self._chunking
            or self._closed
            or (self._tiered is not None and not self._prefilling)
        )

    def _iterate(self) -> bool:
        """One turn of the loop (see the module docstring); False once closed. Idle, it
        waits for work for up to a second."""
        table = self._table
        pending = self._pending
        with self._cond:
            if not self._has_work():
                self._idle = True
                self._cond.wait(1.0)
                if not self._has_work():
                    return True
            self._idle = False
            if self._closed:
                return False
            cancels, self._cancels = self._cancels, []
            arrivals, self._arrivals = self._arrivals, []
            prefilled, self._prefilled = self._prefilled, []
        for got, error, left in arrivals:
            self._install(got, error, left)
        batch: tuple[list, int, int, int] | None = None
        units: list[tuple[list, int, int, int]] = []
        with _xla.compile_counter.request_path(self):
            try:
                self._drop_cancelled(cancels)
                t0, c0 = time.perf_counter(), time.thread_time()
                prefilled = self._insertable(prefilled)  # (their slots step from now on)
                while prefilled:
                    self._insert(prefilled[0])
                    prefilled.pop(0)
                if self._tiered is not None:  # (length tiers in: switch when they fit)
                    self._try_relayout()
                units = self._admit()
                while units:
                    batch = units[0]
                    self._prefill(*batch)
                    batch = None  # in _pending now
                    units.pop(0)
                budget = self.chunk_tokens
                while self._chunking and budget > 0:
                    budget -= self._extend(budget)
                drafts = None
                split = False
                if self._special and self._constrained():
                    # A structured output's next mask needs its last token: what is in
                    # flight is waited for and its tokens fed to the grammars, then
                    # routed once the next step is dispatched (no speculation: drafts
                    # are not masked). With the step as two programs, the masks are
                    # computed while the device runs the forward.
                    for entry in pending:
                        self._peek_grammars(entry)
                    split = getattr(self._full_step, "forward", None) is not None
                elif self.speculative_tokens and table.busy and not self._chunking:
                    drafts = self._drafts()
                if not split:  # (a forward in flight without its pick changes nothing)
                    self._forwarded = None
                stepped = table.busy > 0
                if drafts is not None:
                    self._dispatch_verify(drafts)
                elif split and stepped:
                    self._dispatch_split()
                elif stepped:
                    self._dispatch_step()
                while len(pending) > stepped:
                    self._read(pending[0])
                    pending.popleft()
                if stepped:
                    self.counters["step_wall_s"] += time.perf_counter() - t0
                    self.counters["step_host_cpu_s"] += time.thread_time() - c0
            except Exception as exc:  # noqa: BLE001 - a failed step fails its generations
                if units and batch is not None:  # (the prefills not begun wait again)
                    self._waiting.extendleft(reversed([g for u in units[1:] for g in u[0]]))
                if prefilled:  # (the insert that failed fails with the state; the rest
                    with self._cond:  # go in next turn, into the fresh one)
                        rest = [u for u in prefilled[1:] if u not in self._prefilled]
                        self._prefilled[:0] = rest  # (a unit part-inserted is there)
                self._recover(exc, batch[0] if batch else [])
        return True

    def _drop_cancelled(self, cancels: list[Generation]) -> None:
        """Cancelled generations out of the queue, their slots freed, counted once."""
        for gen in cancels:
            if gen.slot < 0:  # still waiting: it no longer counts
                with contextlib.suppress(ValueError):
                    self._waiting.remove(gen)
            self._unreserve(gen)
            self._table.release(gen)
            if not gen.counted:
                gen.counted = True
                self.outcomes[gen.finish_reason or CANCELLED] += 1  # (set: cancelled)

    def _finished(self, gens: list) -> None:
        ttft, tpot = self._timings["ttft"], self._timings["tpot"]
        outcomes = self.outcomes
        for gen in gens:
            gen.event.set()  # a sync reader of an async-woken generation (see _wake)
            if not gen.counted:
                gen.counted = True
                outcomes[gen.finish_reason] += 1
            ttft.append(gen.t_first - gen.t_submit)
            n = len(gen.tokens)
            if n > 1:
                tpot.append((gen.t_last - gen.t_first) / (n - 1))

    def drain_timings(self) -> dict[str, list[float]]:
        """The durations (seconds) logged since the last call, by kind (``TIMINGS``):
        ``step``: between two steps read back (the inter-token latency of every busy
        slot); ``prefill``: a prefill's dispatch to its first tokens on the host;
        ``ttft``: a finished generation's time to first token; ``tpot``: its time per
        output token after the first."""
        out, self._timings = self._timings, {k: [] for k in TIMINGS}
        return out

    def _wake(self, gens: list) -> None:
        """Wake the readers of ``gens``: on the event loop of an async reader, once per
        loop for all its generations; otherwise the event (a sync reader; ``_finished``
        sets it for every generation that ends, so ``result`` works whoever reads). An
        async reader records its loop before it first looks at the tokens, and the
        tokens are appended before this reads ``gen.loop``: one of the two sees the
        other."""
        by_loop: dict[Any, list] = {}
        for gen in gens:
            loop = gen.loop
            if loop is None:
                gen.woken = False
                gen.event.set()
            else:
                by_loop.setdefault(loop, []).append(gen)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(wake_async, group)
            except RuntimeError:  # the loop was closed: nobody waits there
                for gen in group:
                    gen.woken = False

    def _in_flight(self) -> list:
        """Every generation that may still get a token: in a slot, or in a step or
        prefill not read yet (a slot is given back when its last token is dispatched)."""
        gens = [g for g in self._table.owners if g is not None]
        gens.extend(self._chunking)
        for _, _, who, _, _, _ in self._pending:
            gens.extend(g for g in who if g is not None)
        return gens

    def _recover(self, exc: BaseException, batch: list) -> None:
        """A device call failed: fail every generation in a slot or in flight (and the
        prefill batch being dispatched), and start again from a fresh state (the old one
        may have been donated)."""
        error = RuntimeError(f"decoder {self.name!r}: generation failed: {exc!r}")
        error.__cause__ = exc
        victims = self._in_flight() + list(batch)
        self._drop_pending()
        self._last_step = 0.0
        self._finish_with(victims, error)
        self._state = None  # before allocating another (after an out-of-memory error)
        try:
            if self.group is not None:
                self.group.check()  # a broken group runs nothing more
            self._state, sync = self._launch(len(self._cells) + 1, self._make_state)
            if sync is not None:
                self.group.wait(sync)
            if self.prefix is not None:  # it may have been donated to the failed call
                self.prefix.index.clear()
                self.prefix.box.renew()
        except Exception as again:  # noqa: BLE001 - nothing more can run
            with self._cond:
                self._closed = True
            self._fail(RuntimeError(f"decoder {self.name!r} cannot recover: {again!r}"))

    def _fail(self, error: BaseException) -> None:
        """End everything with ``error``: in flight and waiting (the loop has stopped)."""
        victims = self._in_flight()
        self._drop_pending()
        for unit in [*self._prefilling]:  # (the prefill thread stops with the loop)
            victims.extend(unit.batch[i] for i in unit.left)
        while self._waiting:
            victims.append(self._waiting.popleft())
        victims.extend(self._cancels)
        self._cancels = []
        self._finish_with(victims, error)

    def _drop_pending(self) -> None:
        """Forget the programs in flight (a multi-host group: their answers too)."""
        self._forwarded = None
        if self.group is not None:
            for entry in self._pending:
                self.group.forget(entry[-1])
        self._pending.clear()

    def _finish_with(self, gens: list, error: BaseException) -> None:
        done = []
        for gen in dict.fromkeys(gens):
            self._unreserve(gen)
            self._table.release(gen)
            if gen.finish_reason is None:
                # Its own error (one traceback per reader), caused by the shared one.
                gen.error = type(error)(*error.args)
                gen.error.__cause__ = error.__cause__ or error
                gen.finish_reason = ERROR
            if not gen.counted:
                gen.counted = True
                self.outcomes[gen.finish_reason] += 1
            done.append(gen)
        self._wake(done)


def _serve(ref: weakref.ref, x64: bool) -> None:
    """A decoder's loop thread: its turns while it is open. It holds the decoder while
    there is work and lets go when idle, so a decoder dropped without ``close`` is
    collected (its device memory freed) once its generations are done, and the thread
    ends within a second."""
    with _xla.x64_scope(x64):
        while True:
            decoder = ref()
            if decoder is None:
                return
            try:
                while decoder._iterate():
                    if not decoder._has_work():
                        break
                else:
                    return
            except BaseException as exc:  # the loop itself broke: end what it served
                with decoder._cond:
                    decoder._closed = True
                decoder._fail(RuntimeError(f"decoder {decoder.name!r}: its loop failed: {exc!r}"))
                raise
            del decoder


# Decoders whose loop runs: closed at interpreter exit, before jax tears its backends
# down under a loop thread that still holds their executables (a C++ abort otherwise).
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    for decoder in list(_LIVE):
        with contextlib.suppress(Exception):
            decoder.close()
