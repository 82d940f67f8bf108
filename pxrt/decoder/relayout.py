"""Length tiers applied to a running decoder (``Decoder.set_length_tiers``; with
``pxrt.load(length_tiers="auto")``, the tiers its traffic suggests, once the suggestion
holds): the tiered programs compile on a thread beside the running ones (nothing on the
request path). Once they are in, the loop holds admission until nothing is being
prefilled or chunked and every busy slot fits a row of a tier (its prompt and
``max_tokens``), then one program (``relayout``) moves each busy slot's cache rows, cut
to its tier's length, and its per-slot rows into its new slot, and the host renumbers
the slots: the slot table, each generation's ``slot``, each slot's length. Steps in
flight still route their tokens by their owners' snapshots; the prefix pool is per
block and carries over. A part of ``pxrt.decoder.engine.Decoder`` (a mixin, like
``pxrt.decoder.scheduler``); the programs come from ``pxrt.decoder.load``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .core import Core
else:
    Core = object

log = logging.getLogger("pxrt")

#: Samples in a row (``NEED_SAMPLE_TURNS`` plain steps apart) with the same
#: ``suggested_length_tiers`` before ``length_tiers="auto"`` applies it.
STABLE_SAMPLES = 32
#: After a switch, samples since it before other tiers are asked for, unless they have
#: more long slots than one more (then as soon as the suggestion holds; and every slot
#: long). The quantile of the first few samples is near their largest: under the same
#: traffic it moved again (three switches in 400 requests at 8 slots, two at 32).
SETTLE_SAMPLES = 512
#: Slots (each side) by which a suggestion may differ from the tiers in use, in every
#: tier, and be kept: a sixteenth of the slots (a device's count at least). The
#: suggestion is a 0.99 quantile of a binomial at a sampled share: at 32 slots and a
#: share near a third, a share 0.014 higher is one slot more, and both sides of a
#: rounding moved the demo's tiers by two under the same traffic (16 long slots, then
#: 18 asked for: a compile beside the running programs at half their pace).
BAND_SHARE = 1 / 16
#: The band widens by itself after each switch past the first, up to this many times
#: its width: js-wide at 16 slots under steady traffic switched four times, its long
#: tier 4, 6, 4 slots in turn, each a compile beside the running programs (a run at
#: 0.77x the pace of the next).
BAND_WIDENS = 4


def slot_lengths(tiers: Sequence[tuple[int, int]], n_dev: int) -> tuple[int, ...]:
    """Each (global) slot's cache length under ``tiers``: a device's slots are its rows
    of each tier in turn (``DecoderPrograms.tier_rows``)."""
    local = [length for n, length in tiers for _ in range(n // n_dev)]
    return tuple(local * n_dev)


def tier_pairs(text: str) -> list[tuple[int, int]]:
    """``"20x128+10x256+2x512"`` as [(20, 128), (10, 256), (2, 512)] (``tiers_text``'s
    inverse; a ValueError if it is not of that form)."""
    pairs = [t.split("x") for t in text.split("+")]
    return [(int(n), int(length)) for n, length in pairs]


def tiers_text(tiers: Iterable[tuple[int, int]]) -> str:
    """``tiers`` as ``length_tiers`` takes them: ``"20x128+10x256+2x512"``."""
    return "+".join(f"{n}x{length}" for n, length in tiers)


class Relayout(Core):
    """Changing a running decoder's one cache into length tiers."""

    # (what this part assigns, as ``pxrt.decoder.core.Core`` declares it)
    _state: Any
    _special: bool
    prefix: Any

    def _wire_relayout(self, builder: Any, auto: bool) -> None:
        #: ``pxrt.decoder.load``'s way to the tiered programs, or None: this decoder
        #: cannot change its layout (speculation, a multi-host group).
        self._tier_builder = builder
        #: Whether the tiers the traffic suggests are applied (``length_tiers="auto"``).
        self.auto_tiers = bool(auto) and builder is not None
        #: Where a change of layout stands: "" (none asked), "compiling", "waiting"
        #: (admission held until every busy slot fits a tier), "switched", "failed".
        self.relayout_status = ""
        self._tiered: tuple | None = None  # (tiers, programs, their costs): in, not used
        self._relaid = threading.Event()
        self._relayout_error: BaseException | None = None
        self._suggested: tuple[str | None, int] = (None, 0)  # (the last, how many in a row)
        #: Seconds admission waited between the tiers coming in and the switch.
        self.relayout_wait_s = 0.0
        self.relayout_scale = 1.0

    def set_length_tiers(self, length_tiers: Any, timeout: float | None = None) -> bool:
        """Change this decoder's one cache into ``length_tiers`` (as ``pxrt.load``
        takes them; their slots and longest length this decoder's) while it serves: the
        tiered programs compile on a thread of their own, then the loop switches at the
        first turn where every busy slot fits a tier (admission waits meanwhile), and
        no stream's tokens change. Returns True once switched, False if ``timeout``
        seconds passed first (it goes on). Raises ValueError for tiers that do not fit
        the decoder, or a decoder that cannot change (tiers already, speculation, a
        multi-host group); RuntimeError if their programs failed to compile."""
        if not self.wait_programs(timeout):
            raise TimeoutError(f"set_length_tiers: {self.name!r}'s later programs not in")
        self._ask_tiers(length_tiers)
        done = self._relaid.wait(timeout)
        if self._relayout_error is not None:
            raise RuntimeError(
                f"decoder {self.name!r}: length tiers {length_tiers!r} failed: "
                f"{self._relayout_error!r}"
            ) from self._relayout_error
        return done

    def _ask_tiers(self, given: Any) -> None:
        """Start compiling the programs of tiers ``given`` (checked first)."""
        if self._tier_builder is None:
            raise ValueError(
                f"set_length_tiers: decoder {self.name!r} cannot change its layout (it "
                "speculates, or is in a multi-host group)"
            )
        with self._cond:
            if self.relayout_status in ("compiling", "waiting"):
                raise ValueError(f"set_length_tiers: a change is {self.relayout_status} already")
            status, self.relayout_status = self.relayout_status, "compiling"
            self._relaid.clear()
            self._relayout_error = None
        try:
            tiers = self._tier_builder(self, given)
        except BaseException:
            self.relayout_status = status
            raise
        log.info("pxrt: %s: compiling length tiers %s", self.name, tiers)

    def _maybe_auto(self) -> None:
        """(``length_tiers="auto"``, at each sample of the slots' needs) Ask for the
        suggested tiers once the same suggestion held ``STABLE_SAMPLES`` samples and
        differs from the tiers in use (after a switch the samples start again: more
        long prompts than long slots change the suggestion, and a second switch
        follows; every slot long: one tier of ``max_length``). A suggestion within the
        band of the tiers in use is kept: ``BAND_SHARE`` of the slots, times the
        switches so far (``BAND_WIDENS`` at most)."""
        suggested = self.suggested_length_tiers(whole=bool(self.tiers))
        current = tiers_text(self.tiers)
        last, held = self._suggested
        held = held + 1 if suggested not in (None, current) and suggested == last else 0
        self._suggested = (suggested, held)
        if held >= STABLE_SAMPLES and self.tiers and suggested is not None:
            # A step of ``BAND_SHARE`` of the slots in any tier is within the
            # suggestion's noise: kept (the first samples after a switch count the long
            # prompts it held back; then fewer: 3 and 4 long slots in turn at 16 slots).
            step = max(len(self.devices), math.ceil(self.slots * BAND_SHARE))
            step *= min(max(int(self.counters["relayouts"]), 1), BAND_WIDENS)
            new = {length: n for n, length in tier_pairs(suggested)}
            old = {length: n for n, length in self.tiers}
            whole = len(new) == 1  # (every slot long: at once)
            if not whole and all(abs(new.get(n, 0) - old.get(n, 0)) <= step for n in {*new, *old}):
                return
            grows = whole or new[self.max_length] > old.get(self.max_length, 0) + step
            if not grows and sum(self._need_counts[0].values()) < SETTLE_SAMPLES:
                return
        # (not while programs compiled after the load are still coming, as
        # set_length_tiers waits for them: arriving after a switch, they would be the
        # one cache's)
        if held >= STABLE_SAMPLES and not self.deferred:
            try:
                self._ask_tiers(suggested)
            except ValueError as exc:  # (no room for a second state: the layout stays)
                log.warning("pxrt: %s: keeps its cache's layout: %s", self.name, exc)
                self.auto_tiers = False

    def _tiers_arrived(self, tiers: tuple, got: Any, error: BaseException | None) -> None:
        """(the compiling thread) The tiered programs and their costs, or the error."""
        with self._cond:
            if error is not None or got is None:
                self.relayout_status = "failed"
                self._relayout_error = error or RuntimeError("the decoder closed")
                self._relaid.set()
                return
            self._tiered = (tiers, *got)
            self.relayout_status = "waiting"
            self.relayout_wait_s = time.perf_counter()  # (until the switch: then the wait)
            if self._closed:
                return
            if self._thread is None:
                self._start()
            elif self._idle:
                self._cond.notify()

    def _try_relayout(self) -> None:
        """(the loop's thread, before admission) Switch to the tiers that came in if
        nothing is being prefilled or chunked and every busy slot fits a free tier
        row: the longest need first, each into the shortest row that holds it."""
        if self._prefilling or self._chunking or self._forwarded is not None:
            return
        assert self._tiered is not None
        tiers, got, costs = self._tiered
        lengths = slot_lengths(tiers, len(self.devices))
        order = sorted(range(self.slots), key=lambda s: (lengths[s], s))
        busy = sorted(
            ((len(g.prompt) + g.max_tokens, s, g) for s, g in enumerate(self._table.owners)
             if g is not None),
            key=lambda t: -t[0],
        )  # fmt: skip
        src = np.full(self.slots, self.slots, np.int32)  # (out of range: an empty slot)
        moved = []
        for need, old, gen in busy:
            new = next((s for s in order if lengths[s] >= need), -1)
            if new < 0:
                return  # (a long slot frees up as its stream ends)
            order.remove(new)
            src[new] = old
            moved.append((gen, new))
        self._state, _ = self._launch(-1, got.relayout, self._state, src)
        table = self._table
        table.owners[:] = [None] * self.slots
        for gen, new in moved:
            table.owners[new] = gen
            gen.slot = new
        table.free[:] = sorted(order, reverse=True)
        self._use_tiers(tiers, got, costs)

    def _tier_costs(self, costs: dict[str, float]) -> dict[str, float]:
        """The tiers' prices: their programs were timed while this decoder served, so
        their times are scaled by how much slower the prefill cells (the same work in
        both layouts) timed there than at load; the prefills keep the load's."""
        ratios = [
            self.costs[key] / v
            for key, v in costs.items()
            if key.startswith("prefill[") and self.costs.get(key) and v > 0
        ]
        #: What the tiers' times measured while serving were scaled by (1: not at all).
        self.relayout_scale = min(1.0, float(np.median(ratios))) if ratios else 1.0
        kept = {k: v for k, v in self.costs.items() if k.startswith("prefill[") or k == "dispatch"}
        scaled = {k: v * self.relayout_scale for k, v in costs.items()}
        return scaled | kept

    def _use_tiers(self, tiers: tuple, got: Any, costs: dict[str, float]) -> None:
        """The tiered programs in place of the one cache's, and their prices."""
        special = self._special
        if got.prefix is not None and self.prefix is not None:  # (the pool carries over)
            got.prefix.index, got.prefix.box = self.prefix.index, self.prefix.box
            self.prefix = got.prefix
        self._wire_programs(
            self._params, self._state, got.step, got.make_state, self._bound(got.cells),
            got.parts, None, got.control, got.full_step,
        )  # fmt: skip
        self._special = special
        self._wire_windows({}, got.extends)
        self._wire_tiers(tiers)
        self.step_compile_s = got.step_s
        for kind, n in got.sources.items():
            if kind != "in use":  # (the prefills' rows programs, shared)
                self.program_sources[kind] = self.program_sources.get(kind, 0) + n
        self._price_programs(self._tier_costs(costs), self._itl_bound_ms)
        self._tiered = None
        self.relayout_status = "switched"
        self._suggested = (None, 0)
        self.counters["relayouts"] += 1
        self.relayout_wait_s = time.perf_counter() - self.relayout_wait_s
        log.info(
            "pxrt: %s: switched to length tiers %s (admission waited %.1f ms)",
            self.name, tiers, self.relayout_wait_s * 1e3,
        )  # fmt: skip
        self._relaid.set()
