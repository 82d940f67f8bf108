"""The prefix cache's host side: which blocks of prompt tokens have their cache rows in
the device pool, found by a hash chain over the tokens, evicted least recently used.

A prompt's full blocks of ``block`` tokens are keyed by a chain: block ``i``'s key is a
hash of block ``i - 1``'s key and block ``i``'s tokens, so a key stands for the whole
prefix up to the end of its block (the same tokens after a different start never
match). A lookup walks the chain from the first block and stops at the first miss;
only full blocks are cached, and never a prompt's last token (its logits start the
generation, so at least one token is always computed).

Nothing here waits for the device. The decoder dispatches every program in one order,
so a block copied into a slot (``load``) is read before a later save may overwrite the
same pool entry after an eviction: an entry needs no reference count while a copy of it
is in flight.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any

import numpy as np


class PrefixIndex:
    """Pool entries ``0 .. blocks - 1`` of ``block`` tokens each, by key."""

    def __init__(self, blocks: int, block: int) -> None:
        if blocks < 1 or block < 1:
            raise ValueError(
                f"a prefix cache needs blocks >= 1 and block >= 1, got {blocks}, {block}"
            )
        self.blocks = blocks
        self.block = block
        self._entries: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._free = list(range(blocks - 1, -1, -1))
        #: Counters: prompts looked up, their tokens, tokens found cached, blocks saved,
        #: blocks evicted.
        self.counters = dict.fromkeys(
            ("lookups", "lookup_tokens", "hit_tokens", "saved_blocks", "evicted_blocks"), 0
        )

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, prompt: np.ndarray) -> list[bytes]:
        """The chain of keys of ``prompt``'s cacheable blocks: the full blocks before its
        last token."""
        n = (len(prompt) - 1) // self.block
        data = np.ascontiguousarray(prompt[: n * self.block], dtype=np.int32).tobytes()
        width = 4 * self.block
        keys, parent = [], b""
        for i in range(n):
            parent = hashlib.blake2b(
                parent + data[i * width : (i + 1) * width], digest_size=16
            ).digest()
            keys.append(parent)
        return keys

    def match(self, keys: list[bytes]) -> list[int]:
        """The pool entries of the longest cached start of ``keys`` (in order), marked
        used: the deepest first, so that a prefix stays more recent than its
        continuations and is evicted after them. (``record`` counts a lookup.)"""
        found = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            found.append(key)
        for key in reversed(found):
            self._entries.move_to_end(key)
        return [self._entries[k] for k in found]

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one prompt's lookup: its tokens, and how many were found cached."""
        self.counters["lookups"] += 1
        self.counters["lookup_tokens"] += prompt_tokens
        self.counters["hit_tokens"] += hit_tokens

    def add(self, keys: list[bytes], first: int) -> list[tuple[int, int]]:
        """Entries for ``keys[first:]`` not cached yet, taking free ones, then the least
        recently used (never one of ``keys``): ``(block index, entry)`` pairs whose rows
        the caller saves into the pool next (before anything reads them)."""
        out = []
        mine = set(keys)
        for i in range(first, len(keys)):
            key = keys[i]
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            if self._free:
                entry = self._free.pop()
            else:
                victim = next((k for k in self._entries if k not in mine), None)
                if victim is None:  # the pool holds this prompt's blocks only
                    break
                entry = self._entries.pop(victim)
                self.counters["evicted_blocks"] += 1
            self._entries[key] = entry
            out.append((i, entry))
        for key in reversed(keys):  # the start most recent: evicted after what follows it
            if key in self._entries:
                self._entries.move_to_end(key)
        self.counters["saved_blocks"] += len(out)
        return out

    def clear(self) -> None:
        """Forget every entry (the pool's contents are gone)."""
        self._entries.clear()
        self._free = list(range(self.blocks - 1, -1, -1))


class PoolBox:
    """The pool's arrays on the devices (made by ``make() -> pool``), held where every
    program that writes them finds the latest: each such program is donated the pool
    and returns it (the saves, and the prefill cells that save their prompts' blocks
    as they insert them, ``runner.Saving``)."""

    __slots__ = ("make", "pool")

    def __init__(self, make: Any) -> None:
        self.make = make
        self.pool = make()

    def renew(self) -> None:
        """An empty pool in place of one a failed program may have been donated."""
        self.pool = None  # (before allocating another: after an out-of-memory error)
        self.pool = self.make()


@dataclasses.dataclass
class PrefixPool:
    """The prefix cache: its host index, its device programs and the pool.

    ``load(state, pool, slots[rows], entries[rows, width]) -> state`` copies entries
    into the start of slots (and parks them); ``save(pool, state, slots[width],
    blocks[width], entries[width]) -> pool`` copies a slot's block into an entry (an
    entry out of range is padding): the prompts that go in chunks (a prompt prefilled
    whole saves in its insert)."""

    index: PrefixIndex
    box: PoolBox
    load: Any
    save: Any
    rows: int
    width: int

    @property
    def pool(self) -> Any:
        return self.box.pool

    @pool.setter
    def pool(self, pool: Any) -> None:
        self.box.pool = pool
