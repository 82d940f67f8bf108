"""What pxrt is measured against, on the same model and machine.

- ``run_ceiling``: the device work alone: one bucket executed back to back on a
  prepared staging slot (no requests, no batching, no Python per request).
- ``PlainBatcher``: what a user writes in an afternoon: a list as the queue,
  ``np.concatenate`` + pad, one ``Compiled.__call__`` on a worker thread, results split
  with slices. Eager: a batch goes as soon as fewer than ``max_inflight`` run.
- ``NullBatcher``: the floor of asyncio itself: every caller's future is resolved on the
  next loop iteration, no compute. Nothing that resolves futures on this loop is faster.
- ``run_naive``: one ``Compiled.__call__`` per request from a pool of threads.

All of them use the model's own compiled executables, so the difference measured is
batching and the runtime around the same XLA programs.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import threading
import time
from typing import Any

import jax
import numpy as np

import pxrt

from .loadgen import clock, run_result


def run_ceiling(model: pxrt.Model, duration: float, rows: int | None = None) -> dict:
    """The bucket that ``rows`` rows run in (default: the largest) back to back on a
    prepared staging slot: the rows per second of the device work alone."""
    bucket = model.engine.bucket_for(rows or model.max_batch)
    program, ring = bucket.program, bucket.ring
    slot = ring.acquire()
    try:
        example = pxrt.example_inputs(model.inputs, bucket.size)
        for buf, value in zip(slot.buffers, example.values()):
            buf[...] = value
        program.fetch(program.dispatch(slot))
        n, t0 = 0, clock()
        while clock() - t0 < duration:
            program.fetch(program.dispatch(slot))
            n += 1
        elapsed = clock() - t0
    finally:
        ring.release(slot)
    return {
        "mode": "ceiling",
        "label": f"ceiling: bucket {bucket.size} back to back",
        "rows_per_s": n * bucket.size / elapsed,
        "requests_per_s": float("nan"),
        "exec_ms": elapsed / n * 1e3,
        "bucket": bucket.size,
    }


class PlainBatcher:
    """A plain asyncio dynamic batcher over the model's compiled buckets (see the module
    docstring). ``await batcher.infer(request)`` -> dict of output arrays."""

    def __init__(
        self, model: pxrt.Model, max_batch_size: int | None = None, max_inflight: int = 2
    ) -> None:
        self.buckets = model.buckets
        self.max_rows = min(max_batch_size or model.max_batch, model.max_batch)
        self.max_inflight = max_inflight
        self.names = list(model.inputs)
        self.out_names = list(model.outputs)
        self.compiled = {b: model.engine.bucket_for(b).compiled for b in model.buckets}
        self.params = model.params_dev
        self.x64 = model.artifact.x64
        self.queue: list[tuple[dict, int, asyncio.Future]] = []
        self.inflight = 0
        self.scheduled = False
        self.pool = concurrent.futures.ThreadPoolExecutor(max_inflight)

    async def infer(self, request: dict) -> dict:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.queue.append((request, len(request[self.names[0]]), fut))
        if not self.scheduled and self.inflight < self.max_inflight:
            self.scheduled = True
            loop.call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        self.scheduled = False
        while self.queue and self.inflight < self.max_inflight:
            rows = k = 0
            while k < len(self.queue) and rows + self.queue[k][1] <= self.max_rows:
                rows += self.queue[k][1]
                k += 1
            batch = self.queue[:k]
            del self.queue[:k]
            if not batch:  # a request larger than a batch: not this baseline's job
                self.queue.pop(0)[2].set_exception(ValueError("request over max_batch_size"))
                continue
            self.inflight += 1
            asyncio.ensure_future(self._run(batch, rows))

    def _execute(self, xs: list[np.ndarray], size: int) -> list[np.ndarray]:
        with jax.enable_x64(self.x64):
            return [np.asarray(o) for o in self.compiled[size](self.params, *xs)]

    async def _run(self, batch: list, rows: int) -> None:
        size = self.buckets[bisect.bisect_left(self.buckets, rows)]
        xs = []
        for name in self.names:
            parts = [request[name] for request, _, _ in batch]
            x = np.concatenate(parts)
            if size > rows:
                x = np.concatenate([x, np.zeros((size - rows,) + x.shape[1:], x.dtype)])
            xs.append(x)
        loop = asyncio.get_running_loop()
        try:
            outs = await loop.run_in_executor(self.pool, self._execute, xs, size)
        except Exception as exc:  # noqa: BLE001 - the batch's callers get it
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
        else:
            at = 0
            for _, n, fut in batch:
                if not fut.done():
                    fut.set_result({k: o[at : at + n] for k, o in zip(self.out_names, outs)})
                at += n
        self.inflight -= 1
        self._flush()

    def close(self) -> None:
        self.pool.shutdown()


class NullBatcher:
    """Resolves every waiting future on the next loop iteration, computing nothing:
    the cost of an asyncio future and the callers' own awaits."""

    def __init__(self) -> None:
        self.waiting: list[tuple[Any, asyncio.Future]] = []

    async def infer(self, request: Any) -> Any:
        fut = asyncio.get_running_loop().create_future()
        if not self.waiting:
            asyncio.get_running_loop().call_soon(self._flush)
        self.waiting.append((request, fut))
        return await fut

    def _flush(self) -> None:
        waiting, self.waiting = self.waiting, []
        for request, fut in waiting:
            if not fut.done():
                fut.set_result(request)


def run_naive(model: pxrt.Model, concurrency: int, rows: int, duration: float) -> dict:
    """One Compiled.__call__ per request (padded to the smallest bucket that holds it),
    from ``concurrency`` threads, closed loop."""
    bucket = model.engine.bucket_for(rows)
    compiled, params, size = bucket.compiled, model.params_dev, bucket.size
    x64 = model.artifact.x64
    request = pxrt.example_inputs(model.inputs, rows, seed=1)
    padded = [
        np.concatenate([v, np.zeros((size - rows,) + v.shape[1:], v.dtype)])
        for v in request.values()
    ]
    latencies: list[float] = []
    lock = threading.Lock()
    stop = clock() + duration

    def worker() -> None:
        mine = []
        with jax.enable_x64(x64):
            while clock() < stop:
                t0 = clock()
                outs = compiled(params, *padded)
                [np.asarray(o)[:rows] for o in outs]
                mine.append(clock() - t0)
        with lock:
            latencies.extend(mine)

    # Daemon threads and a watchdog, not a pool: on several CPU devices, jax 0.10.2's
    # Compiled.__call__ from 64 threads has deadlocked here (wide models); the bench
    # reports that instead of hanging with it.
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    t0 = clock()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, stop + 30 - time.perf_counter()))
    elapsed = clock() - t0
    hung = sum(t.is_alive() for t in threads)
    label = f"naive: Compiled.__call__ per request, {concurrency} threads"
    if hung:
        label = f"naive: {hung} of {concurrency} threads HUNG in jax"
    return run_result(
        "naive", label, latencies, rows, elapsed, concurrency=concurrency, hung_threads=hung
    )
