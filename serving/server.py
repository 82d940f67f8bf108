"""The embedded server: models, their batchers and pipelines, metrics.

Async use, on any running asyncio or uvloop loop::

    async with Server() as server:
        server.add_model("mlp", pxrt.load("models/mlp"), max_batch_size=64)
        out = await server.infer("mlp", {"x": x})

Blocking use, with the loop on a background thread (uvloop when installed)::

    with BlockingServer() as server:
        server.add_model("mlp", pxrt.load("models/mlp"))
        out = server.infer("mlp", {"x": x})
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Mapping
from typing import Any

from .batcher import Batcher
from .errors import ServerClosed, UnknownModel
from .metrics import Metrics


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else asyncio's default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _raise(exc: BaseException) -> Any:
    raise exc


class Server:
    """Serves loaded ``pxrt.Model``s to many concurrent callers with dynamic batching.

    Create it on (or enter it from) the event loop that will serve. Every method but
    ``metrics_snapshot`` must be called on that loop's thread.
    """

    def __init__(self) -> None:
        self.metrics = Metrics()
        self._batchers: dict[str, Batcher] = {}
        self._queues: dict[str, Any] = {}  # name -> its batcher's queue, for infer
        self._closed = False

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def add_model(
        self,
        name: str,
        model: Any,
        *,
        max_batch_size: int | None = None,
        max_delay_us: float = 0.0,
        max_queue: int = 4096,
        default_timeout_s: float | None = None,
        max_inflight: int = 2,
        copy: bool = False,
        cell_policy: str = "cost",
    ) -> None:
        """Serve ``model`` (from ``pxrt.load``) as ``name``.

        Args:
          max_batch_size: the most rows in one batch (default and cap: the largest
            compiled bucket); that many rows waiting close a batch at once.
          max_delay_us: an extra wait for fuller batches: how long the oldest queued
            request may wait for ``max_batch_size`` rows when nothing is in flight.
            0 (the default): a request goes at once when the pipeline is idle; under
            load, batches grow by themselves while the device is busy.
          max_queue: queued rows beyond which requests are rejected with ``Overloaded``.
          default_timeout_s: deadline of a request that brings none (None: no deadline).
          max_inflight: batches in flight at once: one executes while the next (a full
            one) is assembled and dispatched.
          copy: hand out owned, writeable outputs instead of read-only views.
          cell_policy: for models with named dimensions, how the next cell is chosen:
            ``"cost"`` (from the execution times measured at load: which lane goes and
            which shorter requests ride along in it) or ``"oldest"`` (the oldest
            request's lane, alone).
        """
        if self._closed:
            raise ServerClosed("the server is closed")
        if name in self._batchers:
            raise ValueError(f"a model named {name!r} is already being served")
        batcher = self._batchers[name] = Batcher(
            name,
            model,
            self.metrics,
            max_batch_size=max_batch_size,
            max_delay_us=max_delay_us,
            max_queue=max_queue,
            max_inflight=max_inflight,
            default_timeout_s=default_timeout_s,
            copy=copy,
            cell_policy=cell_policy,
        )
        self._queues[name] = batcher.queue

    @property
    def models(self) -> dict[str, Any]:
        return {name: b.model for name, b in self._batchers.items()}

    def batcher(self, name: str) -> Batcher:
        batcher = self._batchers.get(name)
        if batcher is None:
            raise UnknownModel(self._unknown(name))
        return batcher

    def _unknown(self, name: str) -> str:
        return f"no model named {name!r}; serving: {', '.join(self._batchers) or 'none'}"

    def infer(
        self, name: str, request: Mapping[str, Any], *, timeout_s: float | None = None
    ) -> Awaitable[dict]:
        """Queue one request (input name -> array of n >= 1 rows) to be batched with
        others; ``await server.infer("mlp", {"x": x})`` -> output name -> array.

        The request is queued when ``infer`` is called, and the awaitable it returns can
        be awaited, gathered, or made a task (``asyncio.create_task`` takes it like a
        coroutine). Awaiting it raises TypeError or ValueError for a malformed request,
        ``Overloaded`` when the queue was full, ``DeadlineExceeded`` when the deadline
        (``timeout_s``, else the model's default) passed while queued,
        ``ExecutionFailed`` when its batch failed, ``ServerClosed`` while shutting down,
        ``UnknownModel`` for a name not served. A caller that stops waiting (its task
        cancelled) takes its request out of the queue if it was not dispatched yet.
        """
        queue = self._queues.get(name)
        try:
            if queue is None:
                raise UnknownModel(self._unknown(name))
            return queue.submit(request, timeout_s)
        except Exception as exc:  # raised where the caller awaits, as from a coroutine
            return _raise(exc)

    def submit(
        self, name: str, request: Mapping[str, Any], *, timeout_s: float | None = None
    ) -> asyncio.Future:
        """``infer`` without the coroutine: queue the request and return its future at
        once (for callers that handle many requests from one task). Errors that
        ``infer`` raises before queueing are raised here; cancelling the future drops
        the request if it was not dispatched yet."""
        return self.batcher(name).queue.submit(request, timeout_s).future

    def metrics_snapshot(self) -> dict[str, dict]:
        """Per model: request outcomes, batches, stage-time and batch-shape summaries."""
        return self.metrics.snapshot()

    async def close(self) -> None:
        """Stop accepting requests, answer every accepted one, stop the pipelines."""
        self._closed = True
        await asyncio.gather(*(b.close() for b in self._batchers.values()))


class BlockingServer:
    """``Server`` for code that is not async: its loop runs on a background thread."""

    def __init__(self) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pxrt-server-loop", daemon=True
        )
        self._thread.start()
        self._server = Server()

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def __enter__(self) -> BlockingServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def server(self) -> Server:
        return self._server

    def add_model(self, name: str, model: Any, **options: Any) -> None:
        """As ``Server.add_model``."""

        async def add() -> None:
            self._server.add_model(name, model, **options)

        self._call(add())

    def infer(self, name: str, request: Mapping[str, Any], *, timeout_s: float | None = None):
        """As ``Server.infer``, blocking the calling thread until the result is in."""

        async def infer() -> dict:  # queued on the loop's thread, not this one
            return await self._server.infer(name, request, timeout_s=timeout_s)

        return self._call(infer())

    def metrics_snapshot(self) -> dict[str, dict]:
        return self._server.metrics_snapshot()

    def close(self) -> None:
        """Answer every accepted request, then stop the loop and its thread."""
        if not self._loop.is_closed():
            if self._loop.is_running():
                self._call(self._server.close())
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
            self._loop.close()
