"""The runner: the decoder's programs and its device state. It fills the host arrays
of a prefill, a chunk, a step or a verify, dispatches the program (through a multi-host
group's leader when there is one), keeps it in flight (``_pending``) and reads it back,
routing the tokens to their generations (``SlotTable``). A part of
``pxrt.decoder.engine.Decoder`` (a mixin, like ``pxrt.decoder.scheduler``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .. import sampling
from ..finish import ERROR, STOP
from . import grammar
from .export import LENGTH_DIM, is_spec
from .overlap import Unit
from .scheduler import AHEAD
from .speculative import _EMA

if TYPE_CHECKING:
    from .core import Core
    from .request import Generation
else:
    Core = object

# What an entry of ``_pending`` (a program in flight) is. An entry is (kind, tokens,
# owners, t0, scores, sync); a block's ``t0`` is the steps it runs.
_PREFILL, _STEP, _VERIFY, _BLOCK = 0, 1, 2, 3


def dropped_prefill(cell: PrefillCell, slots: int) -> tuple[np.ndarray, ...]:
    """A prefill call's host arrays (tokens, ints, floats) for ``cell``'s rows, every
    row dropped (its slot out of range, no block saved): the shapes and work of a real
    call that changes nothing of the state, to warm up or time a cell."""
    c = sampling
    batch, length = cell.batch, cell.length
    ints = np.zeros((batch, cell.ints), np.int32)
    ints[:, c.LEN] = 1
    ints[:, c.SLOT] = slots
    floats = np.ones((batch, c.FLOATS), np.float32)
    return np.zeros((batch, length), np.int32), ints, floats


@dataclasses.dataclass
class PrefillCell:
    """A compiled prefill (``batch`` prompts of ``length`` tokens) or extend (``batch``
    rows of ``length`` new tokens) program."""

    batch: int
    length: int
    compiled: Any
    compile_s: float
    index: int = 0  # in the decoder's programs: what a multi-host leader's header names
    #: Columns of its host ints: ``sampling.INTS``, and with the prefix cache the pool
    #: entry + 1 of each block a prompt saves (``DecoderPrograms.prefill_ints``).
    ints: int = sampling.INTS

    @property
    def saving(self) -> Saving | None:
        """Its program that saves into the prefix pool (a prefill's insert), or None."""
        compiled = self.compiled
        inner = getattr(compiled, "insert", None) or getattr(compiled, "compiled", None)
        return inner if isinstance(inner, Saving) else None


class SplitPrefill:
    """A prefill cell as its two programs (``DecoderPrograms(overlap=True)``): ``rows``
    (the prompts' cache rows and last logits; it reads no state, so it runs on the
    decoder's prefill thread while the steps run) and ``insert`` (into the state, on
    the loop's thread). Called as one, it is the fused program (warm-up, timing)."""

    def __init__(self, rows: Any, insert: Any) -> None:
        self.rows = rows
        self.insert = insert

    def __call__(self, params: Any, state: Any, tokens: Any, ints: Any, floats: Any) -> Any:
        rows, logits = self.rows(params, tokens, ints)
        return self.insert(state, rows, logits, ints, floats)


class Saving:
    """A prefill cell's program that saves its prompts' blocks into the prefix pool as
    it inserts them (``DecoderPrograms._insert_saving``), called as one that does not:
    the pool (``box.pool``) goes in after the state, donated, and comes back after it.
    The box is the decoder's (``Runner._bound`` binds the cells it takes)."""

    def __init__(self, compiled: Any, box: Any, at: int) -> None:
        self.compiled, self.box, self._at = compiled, box, at

    def __call__(self, *args: Any) -> Any:
        at, box = self._at + 1, self.box
        state, box.pool, *out = self.compiled(*args[:at], box.pool, *args[at:])
        return (state, *out)

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()


class Packed:
    """A prefill or extend program called as ``(params, state, tokens, ints, floats)``
    whose host inputs go to the device as one int32 array (``programs.unpacked``): a
    transfer costs ~0.15 ms on a TPU, where three took half a prefill's dispatch."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def __call__(
        self, params: Any, state: Any, tokens: np.ndarray, ints: np.ndarray, floats: np.ndarray
    ) -> Any:
        packed = np.concatenate((tokens, ints, floats.view(np.int32)), axis=1)
        return self.compiled(params, state, packed)

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()


class BlockStep:
    """A plain step compiled as a block (``DecoderPrograms(multi_step=K)``): called
    as a step, ``(params, state, k=1)``, it runs ``k`` steps (at most K) and returns
    (state, tokens ``[K, slots]``, k); ``k`` goes as a scalar already on the devices."""

    def __init__(self, compiled: Any, steps: int, sharding: Any) -> None:
        self.compiled = compiled
        self.steps = steps
        self._ks = [jax.device_put(np.int32(k), sharding) for k in range(steps + 1)]

    def __call__(self, params: Any, state: Any, k: int = 1) -> Any:
        return self.compiled(params, state, self._ks[k])

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()


class FullStep:
    """The step with the sampling controls and scores, called as ``(params, state,
    allowed=None)``: ``allowed`` the slots' allowed tokens (``[slots, words]`` bits, a
    structured output's grammar), None: every token (a copy kept on the devices).
    ``forward`` ``(params, state) -> (state, logits)`` and ``pick`` ``(state, logits,
    allowed) -> (state, tokens, scores)``: the same as two programs, or None;
    ``forwards``: the forward by cache window (0: the whole cache; the plain step's
    windows), those compiled."""

    def __init__(
        self,
        compiled: Any,
        slots: int,
        words: int,
        sharding: Any,
        forwards: dict[int, Any] | None = None,
        pick: Any = None,
    ) -> None:
        self.compiled = compiled
        self._all = jax.device_put(np.full((slots, words), -1, np.int32), sharding)
        got = {w: f for w, f in (forwards or {}).items() if f is not None}
        self.forwards = got if pick is not None and 0 in got else {}
        self.forward = self.forwards.get(0)
        self.pick = pick if self.forward is not None else None

    def __call__(self, params: Any, state: Any, allowed: Any = None) -> Any:
        return self.compiled(params, state, self._all if allowed is None else allowed)

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()


@dataclasses.dataclass
class Controls:
    """A request's sampling controls as the programs take them: the penalties
    (presence, frequency, repetition), the position before which its stop ids are
    banned, the control program's rows (logit bias ids and values, banned ids) and
    its prompt (padded with an id out of the vocabulary); with a structured output, its
    grammar's matcher (``pxrt.decoder.grammar``) and the tokens it has taken."""

    penalties: tuple[float, float, float]
    until: int
    rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    prompt: np.ndarray
    matcher: Any = None
    taken: int = 0
    #: Which of them apply (``sampling.PENALTIES``, ``sampling.GRAMMAR``).
    bits: int = sampling.PENALTIES


class Runner(Core):
    """Dispatch and read: the programs run on the state, their tokens routed."""

    # (what the runner assigns, as ``pxrt.decoder.core.Core`` declares it)
    _state: Any
    _last_step: float
    _forwarded: Any

    def _time_cells(self, cells: list) -> dict[str, float]:
        """Each prefill cell's seconds a run (the median of 3, after one), all its rows
        dropped, on the state in use: the same shapes and work as a real call, and
        nothing of the state changes."""
        costs = {}
        for cell in cells:
            args = dropped_prefill(cell, self.slots)
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                self._state, first, _ = cell.compiled(self._params, self._state, *args)
                jax.block_until_ready(first)
                times.append(time.perf_counter() - t0)
            costs[f"prefill[{cell.batch},{cell.length}]"] = float(np.median(times[1:]))
        return costs

    def _bound(self, cells: list[PrefillCell]) -> list[PrefillCell]:
        """``cells`` (compiled after the load, or for other length tiers) saving into
        this decoder's prefix pool; those that save, left out while it has none (a build
        stopped before the pool's programs)."""
        box = self.prefix.box if self.prefix is not None else None
        out = []
        for cell in cells:
            saving = cell.saving
            if saving is not None:
                if box is None:
                    continue
                saving.box = box
            out.append(cell)
        return out

    def _load_prefixes(self, loads: list[tuple[int, list[int]]]) -> None:
        """Copy cached blocks into the start of slots (one program)."""
        prefix = self.prefix
        assert prefix is not None
        slots = np.full(prefix.rows, self.slots, np.int32)  # out of range: dropped
        entries = np.zeros((prefix.rows, prefix.width), np.int32)
        for i, (slot, got) in enumerate(loads):
            slots[i] = slot
            entries[i, : len(got)] = got
        self._state, _ = self._launch(-1, prefix.load, self._state, prefix.pool, slots, entries)
        self.counters["prefix_loads"] += 1

    def _save_columns(self, rows: list[tuple[int, Generation]], ints: np.ndarray) -> None:
        """The full blocks that the pool lacks of the prompts a prefill's insert writes
        (``(row, generation)``), saved by the insert itself: each block's pool entry
        + 1 in its row's ints past the sampling's (``DecoderPrograms._save_rows``)."""
        prefix = self.prefix
        if prefix is None or ints.shape[1] == sampling.INTS:
            return
        for i, gen in rows:  # (admission computed the keys of those that use it)
            if gen.use_prefix and gen.keys:
                first = gen.hit // prefix.index.block
                for block, entry in prefix.index.add(gen.keys, first):
                    ints[i, sampling.INTS + block] = entry + 1

    def _save_prefixes(self, done: list[tuple[Generation, int]]) -> None:
        """Keep the full blocks of prompts just filled in chunks (``(generation,
        slot)``) that the pool lacks: programs of ``width`` blocks each, dispatched
        after the chunk that wrote them and before anything may overwrite the slots."""
        prefix = self.prefix
        if prefix is None:
            return
        pairs = []
        for gen, slot in done:  # (admission computed the keys of those that use it)
            if gen.use_prefix and gen.keys:
                first = gen.hit // prefix.index.block
                pairs += [(slot, i, e) for i, e in prefix.index.add(gen.keys, first)]
        width, none = prefix.width, prefix.index.blocks
        for at in range(0, len(pairs), width):
            part = pairs[at : at + width]
            slots = np.zeros(width, np.int32)
            blocks = np.zeros(width, np.int32)
            entries = np.full(width, none, np.int32)  # out of range: dropped
            for i, (slot, block, entry) in enumerate(part):
                slots[i], blocks[i], entries[i] = slot, block, entry
            prefix.pool, _ = self._launch(
                -1, prefix.save, prefix.pool, self._state, slots, blocks, entries
            )

    def _extend(self, budget: int) -> int:
        """One chunk for up to ``chunk_batches[-1]`` of the slots being filled, oldest
        first, within ``budget`` tokens (one row at least): ``k`` tokens each, the
        largest chunk length or the smallest that holds what every row has left. A row
        whose prompt this chunk ends samples its first token and joins the steps.
        Returns the tokens it took."""
        table = self._table
        rows: list[Generation] = []
        for gen in self._chunking:
            rows.append(gen)
            if len(rows) == self.chunk_batches[-1]:
                break
        left = max(len(g.prompt) - g.start for g in rows)
        k = next((n for n in self.chunk_lengths if n >= left), self.chunk_lengths[-1])
        rows = rows[: max(1, budget // k)]
        size = next(b for b in self.chunk_batches if b >= len(rows))
        cell = self._extends[(size, k)]
        rows.sort(key=lambda g: len(g.prompt) - g.start > k)  # the prompts it ends first
        tokens, ints, floats = self._host_rows(
            size, k, sampling.CHUNK_INTS, sampling.CHUNK_COUNT, sampling.CHUNK_SLOT
        )
        finals: list[Generation] = []
        done: list[tuple[Generation, int]] = []
        scoring: list[Generation] = []
        for i, gen in enumerate(rows):
            prompt = gen.prompt
            # The chunk ends inside the cache: near its end, it starts earlier and
            # computes some of the prompt's tokens again (the same rows).
            start = min(gen.start, self.max_length - k)
            count = min(len(prompt) - start, k)
            tokens[i, :count] = prompt[start : start + count]
            final = start + count >= len(prompt)
            ints[i, : sampling.CHUNK_WANT] = (
                start, count, gen.reserved, gen.top_k, _seed_bits(gen.seed), final
            )  # fmt: skip
            self._sampling_row(gen, ints[i, sampling.CHUNK_WANT :], floats[i])
            if gen.prompt_parts is not None:  # (its prompt's scores: this chunk's part)
                after = start + count
                ints[i, sampling.CHUNK_PROMPT] = 1
                ints[i, sampling.CHUNK_NEXT] = prompt[after] if after < len(prompt) else 0
                gen.prompt_parts.append((i, start, count))
                scoring.append(gen)
            gen.start = start + count
            if final:
                finals.append(gen)
        t0 = time.perf_counter()
        for gen in rows:
            gen.t_admit = gen.t_admit or t0
        (self._state, first, scores, prompted), sync = self._launch(
            -1, cell.compiled, self._params, self._state, tokens, ints, floats
        )
        if scoring:  # (read with the prompt's first token: ``_prompt_logprobs``)
            prompted.copy_to_host_async()
            for gen in scoring:
                parts = gen.prompt_parts
                assert parts is not None
                parts[-1] = (prompted, *parts[-1])
        for gen in finals:
            self._chunking.remove(gen)
            slot, gen.reserved = gen.reserved, -1
            table.assign(gen, slot)
            done.append((gen, slot))
        if finals:
            first.copy_to_host_async()
            self._pending.append((_PREFILL, first, finals, t0, self._scores(finals, scores), sync))
            self._save_prefixes(done)
        self.counters["chunks"] += 1
        self.counters["chunk_rows"] += len(rows)
        return len(rows) * k

    def _host_rows(
        self, size: int, length: int, columns: int, count: int, slot: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A prefill or extend call's host arrays for ``size`` rows of ``length``
        tokens, every row padding until filled in: one token (column ``count``), a
        slot out of range (column ``slot``: the row is dropped), top-p 1."""
        tokens = np.zeros((size, length), np.int32)
        ints = np.zeros((size, columns), np.int32)
        ints[:, count] = 1
        ints[:, slot] = self.slots
        floats = np.zeros((size, sampling.FLOATS), np.float32)
        floats[:, sampling.TOPP] = 1.0
        floats[:, sampling.REPETITION] = 1.0
        return tokens, ints, floats

    def _sampling_row(self, gen: Generation, ints: np.ndarray, floats: np.ndarray) -> None:
        """``gen``'s sampling parameters into its row of a prefill or extend call:
        ``ints`` from WANT on (WANT, CTRL, UNTIL), ``floats`` whole."""
        controls = gen.controls
        ints[0] = gen.logprobs is not None
        if controls is not None or gen.logprobs is not None:
            self._special = True  # (the steps that follow its first token: the full one)
        floats[sampling.TEMP] = gen.temperature
        floats[sampling.TOPP] = gen.top_p
        if controls is not None:
            ints[1:3] = (controls.bits, controls.until)
            floats[sampling.PRESENCE :] = controls.penalties

    def _write_controls(self, gen: Generation, slot: int) -> None:
        """Before ``gen``'s prompt goes into ``slot``: the slot's control rows (its
        prompt's tokens, logit bias, banned ids; no token counted yet), when it has
        controls."""
        controls = gen.controls
        if controls is None:
            return
        slots = np.full(1, slot, np.int32)
        self._state, _ = self._launch(
            -1, self._control, self._state, slots, controls.prompt, *controls.rows
        )

    @staticmethod
    def _scores(gens: list, scores: Any) -> Any:
        """A program's scores, copied to the host, when one of ``gens`` wants them;
        else None (they are not read)."""
        if not any(gen is not None and gen.logprobs is not None for gen in gens):
            return None
        scores.copy_to_host_async()
        return scores

    def _prefill(self, batch: list, length: int, size: int = 0, beside: int = 0) -> None:
        """Prefill ``batch`` at cell (``size``, ``length``): dispatched now, between two
        steps, or with ``beside`` handed to the prefill thread (``pxrt.decoder.overlap``),
        its slots reserved until it is inserted (``AHEAD``: taken then)."""
        n = len(batch)
        size = size or next(b for b in self.prefill_batches if b >= n)
        cell = self._cells[(size, length)]
        tokens, ints, floats = self._host_rows(size, length, cell.ints, sampling.LEN, sampling.SLOT)
        assign, free = self._table.assign, self._table.free
        for i, gen in enumerate(batch):
            prompt = gen.prompt
            tokens[i, : len(prompt)] = prompt
            ints[i, sampling.LEN] = len(prompt)
            # (beside the steps: the slot is reserved until the rows are inserted)
            chosen = self._chosen.pop(gen, -1)  # (length tiers: the admission's choice)
            if chosen >= 0:
                free.remove(chosen)
            elif beside and beside != AHEAD:
                chosen = free.pop()
            slot = gen.reserved = chosen if beside else assign(gen, chosen)
            ints[i, sampling.SLOT] = slot if slot >= 0 else self.slots  # (ahead: at insert)
            ints[i, sampling.TOPK] = gen.top_k
            ints[i, sampling.SEED] = _seed_bits(gen.seed)
            self._sampling_row(gen, ints[i, sampling.WANT :], floats[i])
            if not beside:
                gen.reserved = -1
                self._write_controls(gen, slot)
        t0 = time.perf_counter()
        for gen in batch:
            gen.t_admit = t0
        self.counters["prefills"] += 1
        self.counters["prefill_rows"] += n
        if beside:
            self._prefill_beside(Unit(cell, tokens, ints, floats, batch, t0))
            return
        self._save_columns(list(enumerate(batch)), ints)
        (self._state, first, scores), sync = self._launch(
            cell.index, cell.compiled, self._params, self._state, tokens, ints, floats
        )
        first.copy_to_host_async()
        self._pending.append((_PREFILL, first, batch, t0, self._scores(batch, scores), sync))

    def _dispatch_step(self) -> None:
        self._sample_needs()  # (what the traffic needs: ``suggested_length_tiers``)
        busy = self._table.busy
        program = None
        if self._special:
            if any(
                g is not None and (g.controls is not None or g.logprobs is not None)
                for g in self._table.owners
            ):
                program, rows = self._full_step, self._rows_per_device
            else:
                self._special = False
        k = 1
        block: tuple[int, ...] = ()
        masks: tuple[np.ndarray, ...] = ()
        full = program is not None
        picked: tuple = ()  # (the forward's logits and the masks, for its pick)
        if full:  # (the full step: the grammars' masks, if any)
            pairs = self._constrained()
            if pairs:
                t0 = time.perf_counter()
                masks = (grammar.grammars_of(self).masks(pairs, self.slots),)
                self.counters["masked_steps"] += 1
                self.counters["grammar_s"] += time.perf_counter() - t0
            window = self._forward_window()
            if window:  # (as its two programs, the forward over a window of the cache)
                picked = (self._forward(window), masks[0] if masks else self._full_step._all)
        else:
            rows = self._compact() if len(self._steps) > 1 else self._rows_per_device
            rows, window = self._cheapest_step(rows)
            program = self._windows[(rows, window)] if window else self._steps[rows]
            if self.multi_step > 1:  # (a block: ``k`` steps in one program)
                k = self._block_size(rows, window)
                block = (k,)
            if window:
                self.counters["window_steps"] += k
        if picked:
            (self._state, tokens, scores), sync = self._launch(
                len(self._cells), self._full_step.pick, self._state, *picked
            )
        else:
            (self._state, tokens, scores), sync = self._launch(
                len(self._cells), program, self._params, self._state, *block, *masks
            )
        tokens.copy_to_host_async()
        owners = self._table.dispatch(k)
        if rows < self._rows_per_device:  # the step's tokens are these slots'
            owners = [owners[s] for s in self._order[rows]]
        # (only the full step computes scores)
        scores = self._scores(owners, scores) if full else None
        kind = _BLOCK if block else _STEP
        self._pending.append((kind, tokens, owners, float(k), scores, sync))
        self._count_step(k, 2 if picked else 1, busy, len(owners))

    @staticmethod
    def _prompt_logprobs(gen: Generation) -> None:
        """``gen``'s prompt's scores, from its chunks' (their programs have run: this
        one's first token is being read): none for the first token, then each token's
        as the positions before it scored it."""
        rows: list[Any] = [None] * len(gen.prompt)
        for array, i, start, count in gen.prompt_parts or ():
            got = np.asarray(array)[i]
            for j in range(count):  # (a chunk may compute some positions again)
                if start + j + 1 < len(rows):
                    rows[start + j + 1] = got[j]
        gen.prompt_logprobs, gen.prompt_parts = rows, None

    def _dispatch_split(self) -> None:
        """A step as two programs while a slot is held to a grammar: the masks of the
        forward in flight (their tokens fed to the grammars already: ``_peek_grammars``)
        computed while the device runs it, its ``pick`` dispatched, and the next
        forward for the slots busy now. A slot whose owner changed since the forward
        (freed, or a prompt inserted) is held by its pick: an empty mask."""
        full = self._full_step
        table = self._table
        group = len(self._cells)
        if self._forwarded is None:  # (the first: a forward now, its pick below)
            self._forward_now()
        logits, seen = self._forwarded
        owners = table.owners
        t0 = time.perf_counter()
        snapshot: list[Any] = [None] * self.slots
        pairs = []
        for slot, gen in enumerate(seen):
            if gen is None or owners[slot] is not gen or gen.finish_reason is not None:
                continue
            snapshot[slot] = gen
            if gen.controls is not None and gen.controls.matcher is not None:
                pairs.append((gen.controls.matcher, slot))
        masks = grammar.grammars_of(self).masks(pairs, self.slots)
        masks[[i for i, g in enumerate(snapshot) if g is None]] = 0  # (held)
        self.counters["grammar_s"] += time.perf_counter() - t0
        (self._state, tokens, scores), sync = self._launch(
            group, full.pick, self._state, logits, masks
        )
        tokens.copy_to_host_async()
        busy = table.busy
        for gen in snapshot:  # (the last token's dispatched: its slot is free now)
            if gen is not None:
                gen.dispatched += 1
                if gen.dispatched >= gen.max_tokens:
                    table.release(gen)
        self._pending.append((_STEP, tokens, snapshot, 1.0, self._scores(snapshot, scores), sync))
        self._forwarded = None
        if table.busy:  # (the next forward: the device runs it while the host computes)
            self._forward_now()
        self._count_step(1, 2, busy, self.slots, masked_steps=1)

    def _forward_window(self) -> int:
        """The cache window the step with the controls runs its forward over (0: the
        whole cache, as one program when it is not split): the cheapest as measured
        at load of those that hold the busy slots (a window's forward writes its part
        back: on a small model that costs what the shorter attention saves, or more);
        the smallest while they are not all measured."""
        forwards = self._full_step.forwards
        window = self._window() if len(forwards) > 1 else 0
        if not window:
            return 0
        options = [w for w in forwards if not w or w >= window]
        prices = self._forward_prices
        if all(w in prices for w in options):
            return min(options, key=lambda w: (prices[w], w))
        return window if window in forwards else 0

    def _forward(self, window: int) -> Any:
        """Dispatch the step with the controls' forward over ``window``: its logits."""
        self.counters["window_steps"] += window > 0
        (self._state, logits), _ = self._launch(
            len(self._cells), self._full_step.forwards[window], self._params, self._state
        )
        return logits

    def _forward_now(self) -> None:
        """Dispatch the split step's forward for the slots busy now."""
        self._forwarded = (self._forward(self._forward_window()), list(self._table.owners))

    def _constrained(self) -> list[tuple[Any, int]]:
        """The busy slots held to a structured output: (its grammar's matcher, slot)."""
        return [
            (g.controls.matcher, slot)
            for slot, g in enumerate(self._table.owners)
            if g is not None and g.controls is not None and g.controls.matcher is not None
        ]

    def _peek_grammars(self, entry: tuple) -> None:
        """Feed a program in flight's tokens to the grammars of its generations that
        have one, before its tokens are routed (``_read``): the next step's masks need
        them, and its routing can then wait until that step is dispatched."""
        kind, array, owners = entry[:3]
        if kind not in (_PREFILL, _STEP):  # (blocks and verifies: never a masked slot's)
            return
        held = [
            (i, gen.controls)
            for i, gen in enumerate(owners)
            if gen is not None and gen.finish_reason is None
            and gen.controls is not None and gen.controls.matcher is not None
        ]  # fmt: skip
        if not held:
            return
        tokens = np.asarray(array)  # (waits for the program)
        t0 = time.perf_counter()
        grammar.grammars_of(self).consume(
            [(c.matcher, int(tokens[i])) for i, c in held if not c.matcher.is_error()]
        )
        for _, controls in held:
            controls.taken += 1
        self.counters["grammar_s"] += time.perf_counter() - t0

    def _advance_grammars(self, gens: list, finished: list) -> None:
        """Feed the tokens ``gens`` got to their grammars' matchers (those not peeked
        at already); a generation whose grammar is complete ends (a stop), one whose
        token it refuses fails."""
        t0 = time.perf_counter()
        for gen in gens:
            controls = None if gen is None else gen.controls
            if controls is None or controls.matcher is None:
                continue
            matcher, new = controls.matcher, gen.tokens[controls.taken :]
            controls.taken = max(controls.taken, len(gen.tokens))
            if new and not matcher.is_error():
                grammar.grammars_of(self).take(matcher, new)
            if gen.finish_reason is not None:
                continue
            if matcher.is_error():
                self._end(gen, ERROR, finished, ValueError(
                    f"structured output: token {gen.tokens[-1]} refused by the grammar: "
                    + matcher.get_error()
                ))  # fmt: skip
            elif matcher.is_stopped():  # (nothing may follow: not even the end token)
                self._end(gen, STOP, finished)
        self.counters["grammar_s"] += time.perf_counter() - t0

    def _end(
        self, gen: Generation, reason: str, finished: list, error: BaseException | None = None
    ) -> None:
        """End ``gen`` on the host (its slot freed; the steps in flight skip it)."""
        gen.finish_reason = reason
        gen.error = error
        self._table.release(gen)
        finished.append(gen)

    def _dispatch_verify(self, drafts: np.ndarray) -> None:
        busy = self._table.busy
        (self._state, tokens, accepted), sync = self._launch(
            -1, self._verify, self._params, self._state, drafts
        )
        tokens.copy_to_host_async()
        accepted.copy_to_host_async()
        owners = self._table.dispatch()
        self._pending.append((_VERIFY, tokens, owners, 0.0, accepted, sync))
        drafted = int((drafts >= 0).sum())
        self._count_step(1, 1, busy, self.slots, verifies=1, drafted_tokens=drafted)

    def _count_step(self, steps: int, programs: int, busy: int, stepped: int, **more: int) -> None:
        """A dispatch's counters: ``steps`` decode steps in ``programs`` programs over
        ``stepped`` slots, ``busy`` of them busy; ``more``: other counters' increments."""
        counters = self.counters
        counters["steps"] += steps
        counters["step_programs"] += programs
        counters["busy_slot_steps"] += busy * steps
        counters["stepped_slots"] += stepped * steps
        for name, n in more.items():
            counters[name] += n

    def _compact(self) -> int:
        """The rows per device the next step runs: the fewest compiled that hold every
        device's busy slots. When fewer would hold them than the busy slots' rows reach,
        the busy slots above are moved down into free rows first (one program, ordered
        before the step on the device; tokens of steps in flight still go by their
        snapshots)."""
        table = self._table
        owners = table.owners
        per = self._rows_per_device
        n_dev = len(self.devices)
        high, busy, held = [0] * n_dev, [0] * n_dev, [0] * n_dev
        for slot, gen in enumerate(owners):
            if gen is not None:
                d, r = divmod(slot, per)
                busy[d] += 1
                high[d] = max(high[d], r + 1)
        for gen in (*self._chunking, *self._in_prefill):  # slots being filled hold theirs
            if gen.reserved >= 0:  # (one prefilled ahead of free slots has none yet)
                held[gen.reserved // per] += 1
        fits = self._fewest_rows
        rows = fits(max(high))
        target = fits(max(max(b + h for b, h in zip(busy, held)), 1))
        if target >= rows:
            return rows
        free = set(table.free)
        moves: list[tuple[int, int]] = []
        for d in range(n_dev):
            base = d * per
            holes = [base + r for r in range(target) if base + r in free]
            movers = [base + r for r in range(target, high[d]) if owners[base + r] is not None]
            moves += zip(movers, holes)
        src = np.full(self.slots, self.slots, np.int32)  # out of range: dropped
        dst = src.copy()
        for i, (a, b) in enumerate(moves):
            src[i], dst[i] = a, b
            gen = owners[a]
            owners[b], owners[a] = gen, None
            gen.slot = b
            free.discard(b)
            free.add(a)
        table.free[:] = sorted(free, reverse=True)
        self._state, _ = self._launch(-1, self._move, self._state, src, dst)
        self.counters["moves"] += len(moves)
        return target

    def _launch(self, index: int, program: Any, *args: Any) -> tuple[Any, Any]:
        """Start ``program(*args)``: (its outputs, the group's step or None). A
        multi-host leader sends program ``index`` and its host inputs (the numpy
        arrays of ``args``) to the followers first, under the group's lock."""
        group = self.group
        if group is None:
            return program(*args), None
        host = [a for a in args if isinstance(a, np.ndarray)]
        with group.lock:
            sync = group.send(index, [host] * len(group.peers))
            return group.launched(sync, lambda: program(*args)), sync

    def _read(self, entry: tuple) -> None:
        kind, array, owners, t0, scores, sync = entry
        if sync is None:
            tokens = np.asarray(array)
        else:
            replies = self.group.wait(sync)  # every follower ran it: nothing diverged
            if kind == _STEP:  # sharded by slot: the followers sent their slots' tokens
                tokens = self._gather(array, replies)
            else:
                tokens = np.asarray(array.addressable_data(0))
        woken: list = []
        finished: list = []
        now = time.perf_counter()
        timings = self._timings
        steps = 0  # (steps read: none for a prefill's first tokens)
        if scores is not None and kind != _VERIFY:  # (each before its token: both read)
            rows = np.asarray(scores)
            for i, gen in enumerate(owners):
                if gen is not None and gen.logprobs is not None and gen.finish_reason is None:
                    gen.logprobs.append(rows[i])
        if kind == _PREFILL:
            for gen in owners:  # (None: a row of a unit prefilled ahead, not this insert's)
                if gen is not None and gen.prompt_parts is not None:
                    self._prompt_logprobs(gen)
            routed = self._table.first(tokens, owners, now, woken, finished)
            timings["prefill"].append(now - t0)
            if self._special:  # (structured outputs' grammars take their first tokens)
                self._advance_grammars(owners, finished)
        else:
            steps = 1
            if kind == _VERIFY:  # (``scores``: how many drafts each slot accepted)
                routed = self._route_verified(tokens, scores, owners, now, woken, finished)
            elif kind == _BLOCK:  # (step by step: a stop ends a generation mid-block)
                steps, route = int(t0), self._table.route
                routed = sum(route(tokens[i], owners, now, woken, finished) for i in range(steps))
            else:
                routed = self._table.route(tokens, owners, now, woken, finished)
            if self._special:
                self._advance_grammars(owners, finished)
            if self._last_step:  # (a block's: the interval per token, once per token)
                timings["step"].extend([(now - self._last_step) / steps] * steps)
                if self.speculative_tokens:
                    which = "verify_s" if kind == _VERIFY else "step_s"
                    spec = self._spec
                    spec[which] += _EMA * (now - self._last_step - spec[which])
            self._last_step = now
        self.counters["tokens"] += routed
        if woken:
            self._wake(woken)
        if finished:
            self._finished(finished)
        placement = self._placement
        if not self._table.busy:
            self._last_step = 0.0  # idle: the next step's interval starts afresh
            if placement is not None:
                placement.idle()
        elif placement is not None:
            placement.read(routed, steps, now)

    @property
    def cache_bytes(self) -> int:
        """Device memory of the cache (all slots, all devices together)."""
        specs = jax.tree.leaves(self.artifact.cache, is_leaf=is_spec)
        tiers = self.tiers or ((self.slots, self.max_length),)
        return sum(n * s.nbytes_at({LENGTH_DIM: length}) for n, length in tiers for s in specs)

    @property
    def pool_bytes(self) -> int:
        """Device memory of the prefix cache's pool (per device: it is replicated)."""
        if self.prefix is None:
            return 0
        at = {LENGTH_DIM: self.prefix.index.block}
        specs = jax.tree.leaves(self.artifact.cache, is_leaf=is_spec)
        return self.prefix.index.blocks * sum(spec.nbytes_at(at) for spec in specs)


def _seed_bits(seed: int) -> int:
    """A uint32 seed as the int32 with its bits (the programs bitcast it back)."""
    return seed - (1 << 32) if seed >= 1 << 31 else seed
