"""Pure-Python twin of ``pxrt._slots``: the per-step host work of generation.

A decode step samples one token for every slot; ``SlotTable.route`` hands each to the
generation that owned the slot when the step was dispatched (a snapshot: the slot may
have been freed and reassigned since), checks its stop conditions, frees the slots of
the generations that finished, and lists the generations to wake. The Cython module
does the same in one C loop; tests hold the two to each other.
"""

from __future__ import annotations

from typing import Any

# Why a generation ended (``Generation.finish_reason``).
STOP = "stop"  # a stop token (end of sequence included)
LENGTH = "length"  # max_tokens, or the cache is full
CANCELLED = "cancelled"
ERROR = "error"


class Generation:
    """One request's generation state as the host loop sees it: the tokens so far and
    what ends it. ``pxrt.generate.Generation`` adds waiting and iteration."""

    __slots__ = (
        "__weakref__",
        "tokens",
        "max_tokens",
        "stop_ids",
        "finish_reason",
        "slot",
        "dispatched",
        "woken",
        "t_first",
        "t_last",
    )

    def __init__(self, max_tokens: int, stop_ids: frozenset) -> None:
        self.tokens: list[int] = []
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.finish_reason: str | None = None
        self.slot = -1
        self.dispatched = 0  # tokens whose computation has been dispatched
        self.woken = False
        self.t_first = 0.0
        self.t_last = 0.0


class SlotTable:
    """Which generation owns each decode slot, and the free slots."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.owners: list[Any] = [None] * slots
        # Popped from the end: slot 0 is taken first.
        self.free: list[int] = list(range(slots - 1, -1, -1))
        self.busy = 0

    def assign(self, gen: Generation, slot: int = -1) -> int:
        """Give ``gen`` a free slot for its prefill (which computes its first token);
        returns it (the caller checked one is free). ``slot``: the one the caller took
        from ``free`` earlier (to fill it over several programs before it joins the
        steps). A generation of one token gives the slot back at once: no step will
        compute for it."""
        if slot < 0:
            slot = self.free.pop()
        self.owners[slot] = gen
        gen.slot = slot
        gen.dispatched = 1
        self.busy += 1
        if gen.max_tokens <= 1:
            self._vacate(slot)
        return slot

    def release(self, gen: Generation) -> None:
        """Free ``gen``'s slot if it still holds one."""
        slot = gen.slot
        if slot >= 0 and self.owners[slot] is gen:
            self.owners[slot] = None
            self.free.append(slot)
            self.busy -= 1
        gen.slot = -1

    def _vacate(self, slot: int) -> None:
        self.owners[slot] = None
        self.free.append(slot)
        self.busy -= 1

    def dispatch(self, steps: int = 1) -> list:
        """A step (or a block of ``steps``) is being dispatched: the owners as it sees
        them (its tokens go to them). A generation whose last token (``max_tokens``)
        it computes gives its slot back now, so that a prompt can be inserted before
        the next step."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        owners = list(self.owners)
        for slot, gen in enumerate(owners):
            if gen is not None:
                gen.dispatched += steps
                if gen.dispatched >= gen.max_tokens:
                    self._vacate(slot)
        return owners

    def route(self, tokens: Any, owners: list, now: float, woken: list, finished: list) -> int:
        """Route one step's sampled tokens (int32, one per slot) to ``owners`` (the
        step's snapshot): generations that got a token go to ``woken`` (once each until
        their ``woken`` flag is cleared), those that ended to ``finished`` too. Returns
        the number of tokens routed."""
        routed = 0
        for slot, gen in enumerate(owners):
            if gen is not None and gen.finish_reason is None:
                self._emit(gen, int(tokens[slot]), now, woken, finished)
                routed += 1
        return routed

    def first(self, tokens: Any, gens: list, now: float, woken: list, finished: list) -> int:
        """Route a prefill's first tokens: row i belongs to ``gens[i]`` (None: to no
        one). Returns the number of tokens routed."""
        routed = 0
        for i, gen in enumerate(gens):
            if gen is not None and gen.finish_reason is None:
                gen.t_first = now
                self._emit(gen, int(tokens[i]), now, woken, finished)
                routed += 1
        return routed

    def _emit(self, gen: Generation, token: int, now: float, woken: list, finished: list) -> None:
        gen.tokens.append(token)
        gen.t_last = now
        if token in gen.stop_ids:
            gen.finish_reason = STOP
        elif len(gen.tokens) >= gen.max_tokens:
            gen.finish_reason = LENGTH
        if gen.finish_reason is not None:
            self.release(gen)
            finished.append(gen)
        if not gen.woken:
            gen.woken = True
            woken.append(gen)
