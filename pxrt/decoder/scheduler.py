"""The loop's scheduler: which waiting prompts go in each turn and how (whole, at the
prefill cell the measured prices choose, or chunk by chunk), in which order (priorities,
aging), and the size of the coming step (the fewest rows, the smallest cache window that
hold the busy slots). Pure host code, no jax: a part of ``pxrt.decoder.engine.Decoder``
(a mixin: the decoder's attributes, ``pxrt.decoder.core``, are its own).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .params import int_in, number_in
from .placement import BETWEEN_STEPS
from .relayout import slot_lengths, tiers_text

if TYPE_CHECKING:
    from .core import Core
    from .request import Generation
else:
    Core = object

#: Prefills handed to the prefill thread (``overlap_prefill``) and not inserted yet, at
#: most: enough to keep the thread busy through a turn of a busy loop (2 left js-small's
#: 32 slots waiting: 0.94-0.98x JetStream's tokens/s against 1.12-1.18x with 4, 8 no
#: better), and the later prompts to the next turns' admission (their priorities).
IN_FLIGHT = 4
#: How an admitted unit is prefilled (the last of ``_admit``'s tuples): between two
#: steps (False), on the prefill thread (True), or there ahead of free slots.
AHEAD = 2
#: The longest a block of steps (``multi_step``) may take at its measured price.
BLOCK_S = 2e-3
#: Plain steps between two samples of the busy slots' lengths (``suggested_length_tiers``).
NEED_SAMPLE_TURNS = 4
#: Samples before ``suggested_length_tiers`` suggests anything.
NEED_SAMPLES = 64
#: Prompts admitted (per slot) before it does: the samples of one generation's slot
#: are alike, so 64 samples can hold a handful of requests. On js-small at 16 slots a
#: warm-up of 64 requests gave one long slot of 512 positions where the traffic needs
#: three (a second switch, and its compile beside the running programs, followed).
NEED_GENERATIONS = 8


def binomial_quantile(n: int, p: float, q: float) -> int:
    """The least k with P(X <= k) >= ``q`` for X ~ Binomial(``n``, ``p``): how many of
    ``n`` slots hold a long need in all but 1 - q of the turns, each at ``p``."""
    if p <= 0.0:
        return 0
    if p >= 1.0:
        return n
    lp, lq, cdf = math.log(p), math.log1p(-p), 0.0
    for k in range(n + 1):  # (each term from logs: (1 - p)^n underflows at many slots)
        log_pmf = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        cdf += math.exp(log_pmf + k * lp + (n - k) * lq)
        if cdf >= q:
            return k
    return n


def row_order(rows: int) -> Callable[[int], tuple[int, int]]:
    """A sort key putting the slots of the lowest rows first (slots are numbered
    device-major, ``rows`` per device): the steps over fewer rows hold them."""
    return lambda slot: (slot % rows, slot // rows)


@dataclasses.dataclass
class _Scan:
    """What one turn's admission has met so far: the prefix blocks that prompts
    admitted before will cache, the prompts held until they are, the cached starts to
    copy in, and the prompts admitted to go in chunks."""

    filling: set[bytes]
    held: list[Generation]
    loads: list[tuple[int, list[int]]]
    chunked: list[Generation] = dataclasses.field(default_factory=list)
    #: With length tiers: the slot chosen for each prompt gathered (taken at prefill).
    chosen: dict[Generation, int] = dataclasses.field(default_factory=dict)


class Scheduler(Core):
    """Admission and its prices, the waiting queue's order, and the steps' size."""

    #: The most prompts a unit prefilled ahead of free slots takes (0: as many as the
    #: largest prefill batch; 1 was the rule before 2026-12-07, kept for comparisons).
    _ahead_rows: int = 0

    def set_priorities(self, levels: int, default_level: int = 0, wait_s: float = 0.1) -> None:
        """Admit waiting prompts by priority: ``levels`` levels (1 the highest), a
        prompt without one at ``default_level`` (0: the lowest), and any prompt that has
        waited ``wait_s`` seconds before every level, oldest first (the batcher's
        ``priority_levels``, ``default_priority_level`` and ``priority_wait_ms``).
        Within a level prompts keep their order. ``levels`` 1: one queue, in order."""
        levels = int_in("priority_levels", levels, 1, None)
        default = int_in("default_priority_level", default_level, 0, levels) or levels
        wait = number_in("priority_wait_s", wait_s, 0.0, math.inf, low_open=True)
        with self._cond:
            self.priority_levels, self.default_priority_level = levels, default
            self.priority_wait_s = wait if levels > 1 else math.inf

    def _admit(self) -> list[tuple[list, int, int, int]]:
        """This turn's prefills, each (prompts, length, batch cell, whether it goes
        beside the steps, or ``AHEAD`` of free slots): waiting prompts in
        order, each unit up to the first that needs a longer prefill than its head's (it
        leads the next unit), at the cell the measured prices choose (``_price``), for
        as long as the turn's prefill budget lasts (one unit at least). A prompt longer
        than the longest prefill, or whose start is in the prefix cache, takes a slot
        of its own to fill chunk by chunk (``_extend``); cached starts are copied in at
        once. A prompt whose next block a prompt admitted before will cache waits for
        it. With every slot taken and prefills beside the steps, the next prompts are
        prefilled ahead of free slots (``_prefills_ahead``)."""
        waiting = self._waiting
        free = self._table.free
        if not waiting or not (free or self._prefills_ahead()) or self._tiered is not None:
            return []  # (with length tiers in, until the loop switches to them)
        if self.priority_levels > 1 and len(waiting) > 1:
            self._by_priority()
        if len(self._steps) > 1:  # the lowest rows first (popped from the end)
            rows = self._rows_per_device
            free.sort(key=row_order(rows), reverse=True)
        # Blocks that prompts admitted before will cache (being chunked, or admitted in
        # this turn: they are saved once prefilled).
        base = self._filling_keys() if self.prefix is not None else set()
        scan = _Scan(set(base), [], [])
        units: list[tuple[list, int, int, int]] = []
        taken, left = 0, self._prefill_budget()
        # Beside the steps (``overlap_prefill``): a unit that costs more than the turn has
        # left goes to the prefill thread, which takes ``IN_FLIGHT`` at a time; unless
        # between two steps made more tokens/s (``placement``) and it fits the bound.
        overlap = self.overlap_prefill
        room = IN_FLIGHT - len(self._prefilling) if overlap else 0
        bound = self._between_budget()
        while waiting and len(free) > taken:  # (the units' slots are taken later)
            batch, length = self._gather_unit(scan, taken)
            if not batch:
                break
            size, rows, cost = self._price(
                len(batch), length, math.inf if overlap else left, first=not units
            )
            beside = overlap and cost > left and cost > bound
            if beside and room <= 0:
                rows = 0
            self._take(scan, batch, rows)
            if self.prefix is not None and rows < len(batch):
                scan.filling = base | {
                    k for g in [*scan.chunked, *batch[:rows]] if g.use_prefix and g.keys
                    for k in g.keys
                }  # fmt: skip
            if rows:
                units.append((batch[:rows], length, size, beside))
                taken += rows
                room, left = (room - 1, left) if beside else (room, left - cost)
                bound -= 0.0 if beside else cost
                self.counters["beside_prefills"] += bool(beside)
                self.counters["priced_prefills"] += self._priced
            if not rows or not self._priced:  # (unpriced: one unit a turn)
                break
        if room > 0 and waiting and len(free) <= taken and self._prefills_ahead():
            units += self._ahead_unit(scan, taken)
        waiting.extendleft(reversed(scan.held))
        if scan.loads:
            self._load_prefixes(scan.loads)
        self._chosen = scan.chosen
        return units

    def _prefills_ahead(self) -> bool:
        """Whether the next prompt may be prefilled before a slot is free for it (its
        rows computed on the prefill thread while every slot steps, inserted into the
        first that frees, as JetStream's prefill engine runs ahead of its slots): while
        the thread has room (``IN_FLIGHT``), prefills go beside the steps and there is
        one priority level (a prompt prefilled ahead is committed: a later one of a
        higher level must not wait behind it). Several prompts a unit where their cell
        makes more prompts per second: each row goes into the first slot to free (with
        length tiers, of a tier that holds it), the unit's rows a few at a time
        (``Overlap._insertable``). Not before a prefill cell is in use (a deferred load
        is ready with the extend cells only: its prompts go in chunks, as slots free)."""
        return (
            self.overlap_prefill and self.priority_levels == 1
            and len(self._prefilling) < IN_FLIGHT and bool(self._cells)
        )  # fmt: skip

    def _ahead_unit(self, scan: _Scan, taken: int) -> list[tuple[list, int, int, int]]:
        """A unit prefilled ahead of free slots (where ``_prefills_ahead``), or none: the
        prompts at the queue's head that go in whole, as many as the cell with the most
        prompts per measured second takes; their slots are taken at insert."""
        batch, length = self._gather_unit(scan, taken, self._ahead_rows or self.prefill_batches[-1])
        if not batch:
            return []
        size, rows, _ = self._price(len(batch), length, math.inf, first=True)
        self._take(scan, batch, rows)
        self.counters["prefills_ahead"] += rows
        return [(batch[:rows], length, size, AHEAD)]

    def _take(self, scan: _Scan, batch: list[Generation], rows: int) -> None:
        """The first ``rows`` of a gathered ``batch`` admitted; the rest back at the
        queue's head, where they lead the next unit."""
        self._waiting.extendleft(reversed(batch[rows:]))
        for gen in batch[rows:]:
            scan.chosen.pop(gen, None)
        for gen in batch[:rows]:
            self._admitted(gen)

    def _gather_unit(self, scan: _Scan, taken: int, ahead: int = 0) -> tuple[list, int]:
        """The next unit's prompts (up to the largest prefill batch, from the queue's
        head; none may need a longer prefill than the first) and its length; admits the
        prompts met on the way that go in chunks (into ``_chunking``). ``ahead``: rows
        past the free slots (a unit prefilled ahead of them: none in chunks)."""
        waiting, free = self._waiting, self._table.free
        block, copies = (self.prefix.index.block, self.prefix.rows) if self.prefix else (0, 0)
        filling = scan.filling
        batch: list[Generation] = []
        length = 0
        while waiting and len(free) + ahead > taken + len(batch):
            gen = waiting[0]
            if gen.finish_reason is not None:  # cancelled while waiting
                waiting.popleft()
                continue
            if self._control is None and (gen.controls is not None or gen.logprobs is not None):
                if self._hold(scan):  # (until its programs are compiled)
                    break
                continue
            entries = self._lookup(gen)
            bucket = self._cell_length(gen.bucket)
            if filling and gen.keys and len(entries) < len(gen.keys):
                if gen.keys[len(entries)] in filling:
                    # A prompt admitted before will cache more of this one's start: this
                    # one waits for it (at the head of the queue; the others go on)
                    # rather than compute the same blocks again.
                    if self._hold(scan):
                        break
                    continue
            if entries or not bucket:  # (no cell for it yet: in chunks)
                if ahead or (entries and len(scan.loads) >= copies):
                    break  # (ahead: no slot to chunk into; else one copy program a turn)
                slot = self._tier_slot(gen, scan.chosen) if self._slot_length else free[-1]
                if slot < 0:  # (length tiers: no free slot of a tier that holds it)
                    if self._hold(scan):
                        break
                    continue
                free.remove(slot)
                waiting.popleft()
                gen.reserved = slot
                self._write_controls(gen, gen.reserved)
                gen.start = gen.hit = len(entries) * block
                if entries:
                    scan.loads.append((gen.reserved, entries))
                self._admitted(gen)
                self._chunking.append(gen)
                scan.chunked.append(gen)
                if gen.use_prefix and gen.keys:
                    filling.update(gen.keys)
                continue
            if len(batch) >= self.prefill_batches[-1] or (length and bucket > length):
                break
            if self._slot_length and not ahead:  # (tiers: a free slot of one that holds it)
                slot = self._tier_slot(gen, scan.chosen)
                if slot < 0:
                    if self._hold(scan):
                        break
                    continue
                scan.chosen[gen] = slot
            length = length or bucket
            batch.append(waiting.popleft())
            if gen.use_prefix and gen.keys:
                filling.update(gen.keys)
        return batch, length

    def _cell_length(self, bucket: int) -> int:
        """The prefill length a prompt of ``bucket`` (its ``Generation.bucket``) runs at
        now: its own once its cells are in use, else the next longer length in use
        (the lengths between the artifact's compile after the others); 0: in chunks
        (no cell in use yet, or the prompt is longer than the longest)."""
        cells = self._cells
        if not bucket or not cells:
            return 0
        least = self.prefill_batches[0]  # (the batches of the cells in use)
        if (least, bucket) in cells:
            return bucket
        return next((n for n in self.prefill_lengths if n > bucket and (least, n) in cells), 0)

    def _hold(self, scan: _Scan) -> bool:
        """The queue's head waits past this turn's units (``scan.held``: it keeps its
        place); whether the scan stops there (a bounded scan per turn)."""
        scan.held.append(self._waiting.popleft())
        return len(scan.held) >= self.slots

    def _price_programs(self, costs: Mapping[str, float], itl_bound_ms: float | None) -> None:
        """The scheduler's prices from the times measured at load (``costs``: seconds
        per ``prefill[b,L]``, ``step[slots]``, and ``dispatch``), and the turn's bound
        (``itl_bound_ms``; default: a full step and the longest single-prompt
        prefill, each as measured, its dispatch included). Without them (a multi-host
        group) each turn runs one prefill sized by the queue."""
        #: The programs' measured seconds, as measured at load.
        self.costs = dict(costs)
        pre = {(b, n): costs.get(f"prefill[{b},{n}]") for b, n in self._cells}
        steps = {n: costs.get(f"step[{n}]") for n in self.step_slots}
        self._priced = int(
            bool(pre) and all(v is not None for v in (*pre.values(), steps[self.slots]))
        )
        self._prefill_cost = {k: v or 0.0 for k, v in pre.items()}
        # Every step program timed (over rows per device, and a window of the cache; 0:
        # all of it): the loop runs the cheapest that holds the busy slots.
        n_dev = len(self.devices)
        self._step_prices = {
            (int(n) // n_dev, int(w or 0)): v
            for key, v in costs.items() if key.startswith("step[")
            for n, _, w in [key[5:-1].partition(",")]
        }  # fmt: skip
        # (the forward of the step with the controls, by window: its own prices)
        self._forward_prices = {
            int(key[8:-1]): v for key, v in costs.items() if key.startswith("forward[")
        }
        full = steps[self.slots] or 0.0
        # A step program's launch, apart from its steps' device time (``measure``).
        self._launch_s = min(costs.get("launch", 0.0), full)
        # (a step not timed is priced as the whole one, which the loop may run instead)
        self._step_cost = {n: min(v, full) if v is not None else full
                           for n, v in steps.items()}  # fmt: skip
        if itl_bound_ms is not None:
            self.itl_bound_s = itl_bound_ms * 1e-3
        elif self._priced:
            least = self.prefill_batches[0]
            longest = max(v for (b, _), v in self._prefill_cost.items() if b == least)
            self.itl_bound_s = self._step_cost[self.slots] + longest
        else:
            self.itl_bound_s = math.inf
        self.counters.setdefault("priced_prefills", 0)

    def _prefill_budget(self) -> float:
        """Seconds of prefill this turn may take: the bound less the coming step's
        price (the fewest slots that hold the busy ones and no more); no bound while no
        slot is busy (no stream waits for its next token: the prompts go in at the
        densest cells). Beside the steps (``overlap_prefill``): the coming step's price,
        what may go between two steps."""
        busy = self._table.busy
        if not self._priced or not busy:
            return math.inf if self._priced else self.itl_bound_s
        step = self._coming_step_cost(busy)
        # Beside the steps: what costs up to a step goes between two (at once: the
        # thread's hop costs its prompts a turn or two), the rest on the prefill thread.
        return step if self.overlap_prefill else self.itl_bound_s - step

    def _between_budget(self) -> float:
        """Seconds of prefill this turn may put between two steps beyond what costs a
        step (``_prefill_budget``), while the measured rule says so
        (``pxrt.decoder.placement``): the bound, or ``BETWEEN_STEPS`` times the coming
        step's price if less, less that price; else 0."""
        placement, busy = self._placement, self._table.busy
        if placement is None or not self._priced or not busy or not placement.rule():
            return 0.0
        step = self._coming_step_cost(busy)
        return min(self.itl_bound_s, BETWEEN_STEPS * step) - step

    def _coming_step_cost(self, busy: int) -> float:
        """The price of the coming step: over the fewest slots that hold ``busy``."""
        return next((self._step_cost[n] for n in self.step_slots if n >= busy), 0.0)

    def _price(self, n: int, length: int, left: float, *, first: bool) -> tuple[int, int, float]:
        """(batch cell, prompts it takes, its price) for a unit of ``n`` prompts at
        ``length`` with ``left`` seconds of the turn's budget: the cell giving the most
        prompts per second among those that fit (a padded cell pays for its padding);
        when none fits, the cheapest if it is the turn's first unit (so every turn
        admits), else none. Unpriced: the smallest cell that holds them all."""
        if not self._priced:
            return next(b for b in self.prefill_batches if b >= n), n, 0.0
        best: tuple[float, int, int, float] | None = None
        cheapest: tuple[float, int, int] | None = None
        for b in self.prefill_batches:
            cost, rows = self._prefill_cost[(b, length)], min(b, n)
            if cheapest is None or cost < cheapest[0]:
                cheapest = (cost, b, rows)
            if cost <= left and (best is None or rows / cost > best[0]):
                best = (rows / cost, b, rows, cost)
        if best is not None:
            return best[1], best[2], best[3]
        if first and cheapest is not None:
            return cheapest[1], cheapest[2], cheapest[0]
        return 0, 0, 0.0

    def _by_priority(self) -> None:
        """Order the waiting prompts: those that waited ``priority_wait_s`` first,
        oldest first; then by level, each level in order of arrival."""
        aged = time.perf_counter() - self.priority_wait_s
        with self._cond:  # (submit appends from other threads)
            order = sorted(
                self._waiting,
                key=lambda g: (0 if g.t_submit <= aged else g.level, g.t_submit),
            )
            self._waiting.clear()
            self._waiting.extend(order)

    def _filling_keys(self) -> set[bytes]:
        """The blocks the prompts being prefilled in chunks will cache when done."""
        return {
            key
            for gen in (*self._chunking, *self._in_prefill) if gen.use_prefix and gen.keys
            for key in gen.keys
        }  # fmt: skip

    def _admitted(self, gen: Generation) -> None:
        self._need_gens += 1
        self.counters["prompt_tokens"] += len(gen.prompt)
        self.counters["prefix_hit_tokens"] += gen.hit
        if self.prefix is not None and gen.use_prefix:
            self.prefix.index.record(len(gen.prompt), gen.hit)

    def _lookup(self, gen: Generation) -> list[int]:
        """The pool entries of ``gen``'s cached start (none: the prefix cache is off for
        it, or nothing of it is cached)."""
        prefix = self.prefix
        if prefix is None or not gen.use_prefix:
            return []
        if gen.keys is None:
            gen.keys = prefix.index.keys(gen.prompt)
        return prefix.index.match(gen.keys) if gen.keys else []

    def _wire_tiers(self, tiers: Sequence[tuple[int, int]]) -> None:
        #: The length tiers (``pxrt.load(length_tiers=...)``): (slots, positions) each.
        self.tiers = tuple(tiers)
        #: Each slot's cache length (its tier's), or () without tiers. A device's slots
        #: are its rows of each tier in turn (``DecoderPrograms.tier_rows``).
        self._slot_length: tuple[int, ...] = ()
        self._chosen = {}
        # What the traffic needs (``suggested_length_tiers``): per sample, how many busy
        # slots need more than a quarter and more than half of max_length.
        self._need_edges = (self.max_length // 4, self.max_length // 2)
        self._need_counts: list[collections.Counter] = [collections.Counter() for _ in range(2)]
        # (the slots counted over every sample: with the counts above, the traffic's
        # share of long needs, whatever the slots' occupancy)
        self._need_slots = 0
        self._need_turn = 0
        self._need_gens = 0  # (prompts admitted since)
        if self.tiers:
            self._slot_length = slot_lengths(self.tiers, len(self.devices))

    def _sample_needs(self) -> None:
        """Every ``NEED_SAMPLE_TURNS`` plain steps: how many busy slots (and slots being
        filled) need (prompt and ``max_tokens``) more than each of ``_need_edges``
        positions, with the waiting prompts at the queue's head as many as slots are
        free (with length tiers, a long prompt waits while short slots are free: what
        more long slots would take)."""
        self._need_turn += 1
        if self._need_turn % NEED_SAMPLE_TURNS:
            return
        # (the slots being filled hold theirs too: a long prompt is chunked, or
        # prefilled beside the steps, for longer than a short one, and while the later
        # prefill cells compile every prompt goes in chunks. Prompts prefilled ahead of
        # free slots hold none: they count with the queue's head; counted as held, 36
        # needs in a sample of 32 slots gave the demo 13x128+19x256 for 3x64+13x128+16x256)
        ahead = [g for g in self._in_prefill if g.reserved < 0]  # (no slot yet: queued)
        filling = [*self._chunking, *(g for g in self._in_prefill if g.reserved >= 0)]
        held = [g for g in self._table.owners if g is not None] + filling
        needs = [len(g.prompt) + g.max_tokens for g in held]
        head = itertools.islice((*ahead, *self._waiting), max(0, self.slots - len(needs)))
        needs += [len(g.prompt) + g.max_tokens for g in head]
        self._need_slots += len(needs)
        for edge, counts in zip(self._need_edges, self._need_counts):
            counts[sum(n > edge for n in needs)] += 1
        if self.auto_tiers and self.relayout_status in ("", "switched"):
            self._maybe_auto()

    def suggested_length_tiers(self, quantile: float = 0.99, whole: bool = False) -> str | None:
        """``length_tiers`` sized by the traffic so far: as many slots of ``max_length``
        as busy slots may need more than half of it (prompt and ``max_tokens``), and one
        more (a long prompt waits only for a long slot: with exactly that many, one at
        16 slots held the longest prompts' queue, TTFT p99 6.6x the one cache's), of
        half as many as may need more than a quarter, less those, and the rest of a
        quarter (each a multiple of the devices). "May need": the larger of the
        ``quantile`` of the counts sampled and the ``quantile`` of the count among
        every slot busy, each slot's need long at the share of long needs sampled (a
        binomial: the samples of a loop whose admission, not its slots, bounds it
        count fewer busy slots than it will fill once it is faster; under tiers sized
        by them at 64 slots on a TPU, a third of the prompts needed the 17 slots over
        a quarter, and TTFT p50 went from 16 to 100 ms). None before ``NEED_SAMPLES``
        samples and ``NEED_GENERATIONS`` prompts per slot admitted, or where every
        slot would be of ``max_length`` (``whole``: then that one tier)."""
        counts = self._need_counts
        total = sum(counts[0].values())
        if total < NEED_SAMPLES or self._need_gens < NEED_GENERATIONS * self.slots:
            return None
        slots = self.slots
        shares = self._need_shares()

        def at(c: collections.Counter, share: float) -> int:
            seen = 0
            for n in sorted(c):
                seen += c[n]
                if seen >= quantile * total:
                    break
            return max(n, binomial_quantile(slots, share, quantile))

        n_dev = len(self.devices)
        up = lambda n: -(-n // n_dev) * n_dev  # noqa: E731
        long = min(up(at(counts[1], shares[1]) + 1), slots)
        half = min(up(max(at(counts[0], shares[0]) - long, 0)), slots - long)
        quarter = slots - long - half
        if long == slots:
            return f"{slots}x{self.max_length}" if whole else None
        edges = (*self._need_edges, self.max_length)
        return tiers_text((n, length) for n, length in zip((quarter, half, long), edges) if n)

    def _need_shares(self) -> list[float]:
        """Of the slots counted in every sample, the share that needed more than each
        of ``_need_edges`` positions."""
        counted = max(self._need_slots, 1)
        return [sum(n * k for n, k in c.items()) / counted for c in self._need_counts]

    def _tier_slot(self, gen: Generation, chosen: Mapping[Generation, int]) -> int:
        """The free slot (none chosen this turn) of the shortest tier that holds
        ``gen``'s prompt and ``max_tokens``; -1 if none is free."""
        need = len(gen.prompt) + gen.max_tokens
        lengths, taken = self._slot_length, set(chosen.values())
        best = -1
        for slot in self._table.free:
            length = lengths[slot]
            if length >= need and slot not in taken and (best < 0 or length < lengths[best]):
                best = slot
        return best

    def _unreserve(self, gen: Generation) -> None:
        """``gen`` no longer fills a slot chunk by chunk: the slot is free again (one
        being prefilled beside the steps gives it back when its rows are inserted)."""
        if gen.reserved >= 0 and gen not in self._in_prefill:
            with contextlib.suppress(ValueError):
                self._chunking.remove(gen)
            self._table.free.append(gen.reserved)
            gen.reserved = -1

    def _window(self) -> int:
        """The smallest cache window every busy slot's next position is under (0: the
        whole cache). A slot's position on the device runs ahead of the tokens read by
        the steps and the prefill not read yet (and a verify's drafts): bounded here by
        its prompt, its tokens read and that margin."""
        margin = 3 + self.speculative_tokens + 2 * self.multi_step
        need = max(
            (len(g.prompt) + len(g.tokens) for g in self._table.owners if g is not None),
            default=0,
        )
        return next((w for w in self.step_lengths if w >= need + margin), 0)

    def _block_size(self, rows: int, window: int) -> int:
        """How many steps the next plain step program (over ``rows`` per device and
        ``window``) runs: up to ``multi_step`` and as many as fit in ``BLOCK_S`` at its
        measured price, its launch once and its device time per step (a block's tokens
        reach their streams together: bursts a reader of text cannot see, and no
        longer than that), so blocks run where steps are cheap and the host's share of
        each is large: on an accelerator, where a launch outweighs a small model's step
        (a TPU's ~1 ms against 0.2 ms), a whole step's price would allow none. One
        while something waits on the turns between steps (a prompt for a free slot: the
        turn's prefill budget held it back, so the turns' pace is its admission's; a
        prefill to insert, a chunk); with prompts waiting and no slot free, up to the
        first ``max_tokens`` a busy generation reaches (its slot is free for the next
        turn's admission). A stop token ends its generation mid-block (the rest of the
        block computes for nothing in that slot)."""
        price = self._step_prices.get((rows, window)) or self._step_cost.get(self.slots)
        most = self.multi_step
        if price:
            launch = self._launch_s
            step = max(price - launch, 1e-6)
            most = min(most, max(1, int((BLOCK_S - launch) / step + 1e-9)))
        if most <= 1 or self._chunking or self._prefilling or self._prefilled:
            return 1
        if self._waiting:
            if self._table.free:
                return 1
            owners = self._table.owners
            left = min((g.max_tokens - g.dispatched for g in owners if g is not None), default=1)
            return max(1, min(most, left))
        return most

    def _cheapest_step(self, rows: int) -> tuple[int, int]:
        """(rows per device, cache window; 0: all of it) of the step to run, the busy
        slots being within the first ``rows`` of each device: the cheapest measured of
        those that hold them (a step over fewer slots or positions can cost more than
        the whole one: XLA may copy the cache to update a part of it); the fewest rows
        and the smallest window while they are not all measured."""
        window = self._window() if self.step_lengths else 0
        widths = [0, *(w for w in self.step_lengths if window and w >= window)]
        options = [(r, w) for r in self._steps if r >= rows for w in widths]
        prices = self._step_prices
        if all(o in prices for o in options):
            return min(options, key=lambda o: (prices[o], o))
        return rows, window

    def _fewest_rows(self, need: int) -> int:
        return min(rows for rows in self._steps if rows >= need)

    def scheduler_choices(self) -> dict:
        """How the loop's scheduler chooses, from the times measured at load: the
        turn's bound, and for 1, 2, 4... prompts of each prefill length waiting, the
        first prefill it runs (batch cell and prompts taken) with no slot busy and with
        every slot busy."""
        if not self._priced:
            return {"priced": False}
        full = math.inf if self.overlap_prefill else self.itl_bound_s - self._step_cost[self.slots]
        waiting = sorted({1, 2, *self.prefill_batches})
        choices = []
        for length in self.prefill_lengths:
            for n in waiting:
                idle = self._price(n, length, math.inf, first=True)
                busy = self._price(n, length, full, first=True)
                choices.append(
                    {"waiting": n, "length": length, "idle": list(idle[:2]), "busy": list(busy[:2])}
                )
        tiers: dict[str, Any] = {}
        if self.tiers:
            tiers["length_tiers"] = [list(t) for t in self.tiers]
        suggested = self.suggested_length_tiers()
        if suggested:
            tiers["suggested_length_tiers"] = suggested
        if self._need_slots:  # (what the suggestion is sized by)
            tiers["need_shares"] = {
                str(edge): round(share, 4)
                for edge, share in zip(self._need_edges, self._need_shares())
            }
        if self.auto_tiers or self.relayout_status:
            tiers["auto_tiers"] = self.auto_tiers
            tiers["relayout"] = self.relayout_status or "not yet"
            if self.relayout_status == "switched":
                tiers["relayout_wait_ms"] = round(self.relayout_wait_s * 1e3, 3)
                tiers["relayout_price_scale"] = round(self.relayout_scale, 4)
        return {
            "priced": True,
            "overlap_prefill": self.overlap_prefill,
            **(
                {"prefill_placement": self._placement.describe()}
                if self._placement is not None else {}
            ),  # fmt: skip
            "in_flight": IN_FLIGHT,
            "itl_bound_ms": round(self.itl_bound_s * 1e3, 4),
            "dispatch_ms": round(self.costs.get("dispatch", 0.0) * 1e3, 4),
            "multi_step": self.multi_step,
            "step_launch_ms": round(self._launch_s * 1e3, 4),
            **tiers,
            "choices": choices,
        }
