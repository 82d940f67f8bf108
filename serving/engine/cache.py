"""The response cache (Triton's ``response_cache``): answers of deterministic models,
kept by a hash of the request, so a repeated request is answered without the device.

One ``ResponseCache`` per server, bounded in bytes (the outputs' bytes) with LRU
eviction (``cachetools.LRUCache``), shared by the models that enable it
(``BatchingOptions.response_cache``). A request's key is its model (the batcher that
serves that version: a version loaded again starts empty) and a BLAKE2b digest of its
inputs, names, dtypes, shapes and bytes: a cryptographic hash, so no client can make a
request that collides with another client's to read or poison its answer. Only answers
that succeeded are kept; requests with object (string) tensors are never cached. Inputs
in a client's shared memory (``serving.kserve.shm``), which the client can rewrite until
its batch reads them, are copied before they are hashed: the copy is what runs, so an
answer is only ever kept under the bytes that produced it.

``CachedEntry`` stands in front of a model's queue: ``submit`` answers a hit at once (a
done future) and queues a miss, keeping its answer once it comes.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import operator
import time
from collections.abc import Mapping
from typing import Any, cast

import cachetools
import numpy as np

from ..kserve.shm import private

_clock = time.perf_counter


class ResponseCache:
    """Answers kept by request, within ``max_bytes`` of outputs, least recently used
    first out. Used on the event loop's thread only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: cachetools.LRUCache = cachetools.LRUCache(
            maxsize=max_bytes, getsizeof=operator.itemgetter(1)
        )
        self._owners = itertools.count()
        self.evictions = 0

    def owner(self) -> int:
        """A token for one model version's entries (its keys start with it)."""
        return next(self._owners)

    def get(self, key: tuple) -> dict[str, np.ndarray] | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: tuple, outputs: dict[str, np.ndarray]) -> None:
        """Keep ``outputs`` (read-only copies: a batch's outputs are views of it) unless
        they alone are over the budget."""
        kept = {}
        size = 0
        for name, value in outputs.items():
            value = value.copy()
            value.flags.writeable = False
            kept[name] = value
            size += value.nbytes
        size = max(size, 1)  # (an answer of empty arrays counts too)
        if size > self.max_bytes:
            return
        entries = self._entries
        before = len(entries)
        entries[key] = (kept, size)
        self.evictions += before + 1 - len(entries)

    def drop(self, owner: int) -> None:
        """Forget one model version's entries (it is no longer served)."""
        for key in [k for k in self._entries if k[0] == owner]:
            del self._entries[key]

    @property
    def bytes(self) -> int:
        return int(self._entries.currsize)

    def __len__(self) -> int:
        return len(self._entries)


def request_digest(request: Mapping[str, Any]) -> bytes | None:
    """The BLAKE2b digest of a request's inputs (each name, dtype, shape and bytes, in
    name order), or None when it cannot be cached (object or string tensors, anything
    that is not an array)."""
    h = hashlib.blake2b(digest_size=16)
    try:
        for name in sorted(request) if len(request) > 1 else request:
            value = request[name]
            if type(value) is not np.ndarray:
                value = np.asarray(value)
            dtype = value.dtype
            if dtype.hasobject:
                return None
            if not value.flags.c_contiguous:
                value = np.ascontiguousarray(value)
            h.update(b"%s\0%s%r\0" % (name.encode(), dtype.str.encode(), value.shape))
            h.update(cast(Any, value))  # (its bytes: an array is a buffer)
    except (TypeError, ValueError, UnicodeEncodeError):  # the queue's validation says why
        return None
    return h.digest()


class _Answered:
    """A hit: awaitable like a queued request, its future already done."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future

    def __await__(self) -> Any:
        return self.future.__await__()


class CachedEntry:
    """A model's queue behind the response cache: ``submit`` as the queue's."""

    def __init__(self, queue: Any, cache: ResponseCache, copy: bool) -> None:
        self.queue = queue
        self.cache = cache
        self.copy = copy
        self.owner = cache.owner()
        self._loop = asyncio.get_running_loop()
        self.hits = 0
        self.misses = 0
        self.hit_s = 0.0  # looking up hits, answering them
        self.miss_s = 0.0  # looking up misses, keeping their answers

    def submit(self, request: Any, timeout: float | None = None, priority: int = 0) -> Any:
        queue = self.queue
        if queue.closed or (priority and not 1 <= priority <= queue.levels):
            # What the queue refuses, it refuses before any lookup (and counts): a hit
            # must not answer a request that a miss would refuse.
            return queue.submit(request, timeout, priority)
        t0 = _clock()
        digest = None
        if type(request) is dict or isinstance(request, Mapping):
            request = private(request)  # (hashed as it runs: see the module)
            digest = request_digest(request)
        if digest is None:
            return self.queue.submit(request, timeout, priority)
        key = (self.owner, digest)
        outputs = self.cache.get(key)
        if outputs is not None:
            if self.copy:
                outputs = {k: v.copy() for k, v in outputs.items()}
            future = self._loop.create_future()
            future.set_result(dict(outputs))
            self.hits += 1
            self.hit_s += _clock() - t0
            return _Answered(future)
        self.misses += 1
        self.miss_s += _clock() - t0
        queued = self.queue.submit(request, timeout, priority)
        queued.future.add_done_callback(lambda f: self._keep(key, f))
        return queued

    def _keep(self, key: tuple, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        t0 = _clock()
        self.cache.put(key, future.result())
        self.miss_s += _clock() - t0

    def close(self) -> None:
        self.cache.drop(self.owner)

    def counts(self) -> dict[str, float]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_s": self.hit_s,
            "miss_s": self.miss_s,
        }
