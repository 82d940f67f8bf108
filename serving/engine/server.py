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
import functools
import gc
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pxrt import Model

from ..errors import DeadlineExceeded, Overloaded, ServerClosed, ServingError, no_model, no_version
from ..kserve.shm import OFF as SHM_OFF
from ..kserve.shm import SharedMemory
from .batcher import Batcher
from .cache import ResponseCache

if TYPE_CHECKING:
    from pxrt.generate import Decoder, Generation, SamplingParams

    from ..tracing import Trace, Tracing
from ..loops import new_event_loop
from ..options import BatchingOptions, GenerationLimits, OptionError
from .metrics import Metrics


async def _raise(exc: BaseException) -> Any:
    raise exc


async def _retire(decoder: Decoder, grace_s: float = 30.0) -> None:
    """Close a decoder no longer served once its generations are done (at most
    ``grace_s`` seconds: what is still running then ends with ``ServerClosed``)."""
    deadline = asyncio.get_running_loop().time() + grace_s
    while (decoder.busy_slots or decoder.waiting) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.to_thread(decoder.close)


def version_order(version: str) -> tuple:
    """How versions sort: numbers numerically (2 < 10), before any other name."""
    return (0, int(version), "") if version.isdigit() else (1, 0, version)


class Server:
    """Serves loaded ``pxrt.Model``s to many concurrent callers with dynamic batching.

    Create it on (or enter it from) the event loop that will serve. Every method but
    ``metrics_snapshot`` must be called on that loop's thread.

    Args:
      ready: whether it takes inference requests from the start (front ends answer
        "loading" until ``ready`` is set: ``pxrt serve`` sets it once every model is
        warm).
      on_models_changed: called after a model is loaded or unloaded through
        ``load_model``/``unload_model`` (``pxrt serve`` re-freezes the garbage
        collector there). Without one, an unload runs a collection, which releases the
        model's device memory at once.
      response_cache_mb: the response cache's budget, in MiB of outputs, shared by the
        models that enable it (``response_cache=True``); least recently used answers go
        first. 0: no cache (a model asking for it is refused).
      tracing: which inference requests get OpenTelemetry spans (``serving.Tracing``;
        None: none), through every front end.
      allow_client_shm: serve Triton's system shared memory extension
        (``serving.kserve.shm``): clients on this host register POSIX shared memory and
        name it in requests. Off by default (Triton's ``--allow-client-shm``): a client
        that registers a segment reads and writes what the server's user may.
      allow_remote_shm: with ``allow_client_shm``, take registrations from clients on
        other hosts too (``--allow-remote-shm``; default: from loopback only).
    """

    def __init__(
        self,
        *,
        ready: bool = True,
        on_models_changed: Callable[[], None] | None = None,
        generation_limits: GenerationLimits = GenerationLimits(),
        response_cache_mb: float = 256,
        tracing: Tracing | None = None,
        allow_client_shm: bool = False,
        allow_remote_shm: bool = False,
    ) -> None:
        if not (isinstance(response_cache_mb, (int, float)) and response_cache_mb >= 0):
            raise ValueError(f"response_cache_mb must be a number >= 0, got {response_cache_mb!r}")
        self._ready = ready
        #: Which requests are traced (the front ends ask it), or None.
        self.tracing = tracing
        #: The system shared memory regions clients registered (every front end's).
        self.shared_memory = SharedMemory(
            None if allow_client_shm else SHM_OFF, allow_remote=allow_remote_shm
        )
        #: What one generation request may ask (its stop strings...), every protocol.
        self.generation_limits = generation_limits
        self._failed: str | None = None
        self._draining = asyncio.Event()  # set by drain(): streams end on it
        self._watchers: list[Callable[[], None]] = []
        self.on_models_changed = on_models_changed
        #: Answers of the models that enable it (``response_cache``), or None.
        self.response_cache = (
            ResponseCache(int(response_cache_mb * 2**20)) if response_cache_mb else None
        )
        self.metrics = Metrics(self.response_cache)
        # name -> version -> its batcher: every version served.
        self._versions: dict[str, dict[str, Batcher]] = {}
        # name -> the batcher of the version that unversioned requests reach (the newest).
        self._batchers: dict[str, Batcher] = {}
        self._queues: dict[str, Any] = {}  # name -> that batcher's queue, for infer
        self._closing: set[Batcher] = set()
        # name -> a decoder served (generation: ``generate``).
        self._decoders: dict[str, Decoder] = {}
        self._closed = False

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def add_model(
        self,
        name: str,
        model: Model,
        options: BatchingOptions | None = None,
        **changes: Any,
    ) -> None:
        """Serve ``model`` (from ``pxrt.load``) as ``name``, version ``model.version``. A
        new version of a name already served joins it: unversioned requests go to the
        newest version from then on, older ones stay reachable by version.

        ``options`` (default ``BatchingOptions()``) with ``changes`` over them: how its
        requests are batched and queued (``max_batch_size``, ``max_delay_us``,
        ``max_queue``, ``default_timeout_s``, ``max_inflight``, ``copy``,
        ``cell_policy``; see ``BatchingOptions``). A bad value raises ``OptionError``.
        """
        options = BatchingOptions.from_mapping(changes, options)
        if self._closed:
            raise ServerClosed("the server is closed")
        if name in self._decoders:
            raise ValueError(f"a decoder named {name!r} is already being served")
        if model.version in self._versions.get(name, {}):
            raise ValueError(f"version {model.version!r} of model {name!r} is already being served")
        batcher = Batcher(
            name, model, self.metrics, options, quiet=self._quiet, cache=self.response_cache
        )
        self._versions.setdefault(name, {})[model.version] = batcher
        self._route(name)

    def add_decoder(
        self, name: str, decoder: Decoder, options: BatchingOptions | None = None
    ) -> None:
        """Serve a decoder (``pxrt.load`` of a decoder artifact) as ``name``: its
        generations through ``generate``, its numbers in the metrics. Its loop batches
        continuously on its own thread; ``close`` closes it. ``options``: what the model's
        configuration gave it (a decoder batches by itself: only checked, but for its
        priorities, which order the prompts waiting for a slot)."""
        if options is not None and options.response_cache:
            raise OptionError(
                f"option response_cache: model {name!r} is a decoder; its generations are "
                "sampled and streamed, and the response cache keeps batched models' answers"
            )
        if self._closed:
            raise ServerClosed("the server is closed")
        if name in self._decoders or name in self._versions:
            raise ValueError(f"a model named {name!r} is already being served")
        if options is not None and options.priority_levels > 1:
            decoder.set_priorities(
                options.priority_levels,
                options.default_priority_level,
                options.priority_wait_ms * 1e-3,
            )
        self._decoders[name] = decoder
        self.metrics.add_decoder(name, decoder, decoder.version)
        self._changed()

    def is_decoder(self, name: str) -> bool:
        """Whether ``name`` is a decoder served (``add_decoder``)."""
        return name in self._decoders

    def decoder(self, name: str) -> Decoder:
        """The decoder served as ``name``; ``UnknownModel`` when there is none."""
        decoder = self._decoders.get(name)
        if decoder is None:
            raise no_model(name, list(self._decoders))
        return decoder

    def start_generation(
        self,
        name: str,
        prompt: Sequence[int] | Any,
        params: SamplingParams | None = None,
        **options: Any,
    ) -> Generation:
        """Submit one generation to the decoder ``name`` and return its handle
        (``pxrt.Generation``: iterate it, cancel it); the front ends' entry.
        ``params`` or ``options`` as for ``pxrt.Decoder.submit``. Errors as for
        ``generate``, raised here."""
        from pxrt.generate import DecoderClosed, QueueFull

        if self._closed:
            raise ServerClosed("the server is closed")
        decoder = self.decoder(name)
        try:
            return decoder.submit(prompt, params, **options)
        except QueueFull as exc:
            raise Overloaded(str(exc), exc.retry_after_s) from None
        except DecoderClosed as exc:
            raise ServerClosed(str(exc)) from None

    async def open_generation(
        self,
        name: str,
        prompt: Sequence[int] | Any,
        params: SamplingParams | None = None,
        **options: Any,
    ) -> Generation:
        """``start_generation`` as the front ends call it (the same call on a
        ``--workers`` worker's ``RemoteServer`` waits for the device process)."""
        return self.start_generation(name, prompt, params, **options)

    async def generate(
        self,
        name: str,
        prompt: Sequence[int] | Any,
        *,
        timeout_s: float | None = None,
        params: SamplingParams | None = None,
        **options: Any,
    ) -> AsyncIterator[int]:
        """The tokens the decoder ``name`` generates for ``prompt`` (token ids), as they
        come: ``async for token in server.generate("lm", ids, max_tokens=64)``.

        ``params`` (a ``pxrt.SamplingParams``) or its fields as ``options``
        (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_ids``,
        ...), as for ``pxrt.Decoder.submit``. Leaving the loop early, or
        cancelling the task, cancels the generation: its slot is free for the next step.
        Raises ValueError naming what is wrong with a bad request, ``Overloaded`` when
        the decoder's waiting queue is full, ``DeadlineExceeded`` when ``timeout_s``
        passes before the generation ends (the tokens before it were delivered),
        ``ServerClosed`` once the server is closed or closing (an open generation ends
        with it when ``close`` closes the decoders), ``UnknownModel`` for a name not
        served.
        """
        from pxrt.finish import DEADLINE
        from pxrt.generate import DecoderClosed

        if timeout_s is not None and not (
            isinstance(timeout_s, (int, float))
            and not isinstance(timeout_s, bool)
            and math.isfinite(timeout_s)
            and timeout_s >= 0
        ):
            raise ValueError(f"timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
        gen = self.start_generation(name, prompt, params, **options)
        timer = None
        try:
            if timeout_s is not None:
                timer = asyncio.get_running_loop().call_later(timeout_s, gen.cancel, DEADLINE)
            async for token in gen:
                yield token
        except DecoderClosed as exc:
            raise ServerClosed(str(exc)) from None
        finally:
            if timer is not None:
                timer.cancel()
            gen.cancel()
        if gen.finish_reason == DEADLINE:
            raise DeadlineExceeded(
                f"model {name!r}: the generation did not end within {timeout_s} s "
                f"({len(gen.tokens)} tokens were generated)"
            )

    def _quiet(self) -> bool:
        """Nothing waits or runs on any model or decoder this server serves (a batcher
        re-measures its cells' times only then)."""
        return all(
            b._idle() for versions in self._versions.values() for b in versions.values()
        ) and not any(d.busy_slots or d.waiting for d in self._decoders.values())

    def _route(self, name: str) -> None:
        """Unversioned requests for ``name`` go to its newest version from now on (one
        assignment on the loop's thread: the switch is atomic for callers)."""
        versions = self._versions.get(name)
        if not versions:
            self._versions.pop(name, None)
            self._batchers.pop(name, None)
            self._queues.pop(name, None)
            self.metrics.set_default(name, None)
            self._changed()
            return
        newest = max(versions, key=version_order)
        batcher = versions[newest]
        self._batchers[name] = batcher
        self._queues[name] = batcher.entry
        self.metrics.set_default(name, newest)
        self._changed()

    async def load_model(
        self,
        name: str,
        path: str,
        *,
        version: str | None = None,
        load_options: dict | None = None,
        options: BatchingOptions | None = None,
        replace: bool = False,
        **changes: Any,
    ) -> Model | Decoder:
        """Load the artifact at ``path`` (compiling every bucket on a worker thread while
        everything served keeps serving) and serve it as a version of ``name``: its
        manifest's version (or ``version``), which must be new unless ``replace``. Once
        it is compiled and warm, requests without a version go to the newest version;
        older versions stay reachable by version until ``unload_model``. ``replace``: a
        version served already (its files changed) is served by the new load from then
        on, and the old one answers what it accepted, then is released. A load that
        fails raises and changes nothing.
        ``load_options`` go to ``pxrt.load``, ``options`` and ``changes`` to
        ``add_model`` (checked before anything loads); returns the loaded model."""
        import pxrt

        if self._closed:
            raise ServerClosed("the server is closed")
        options = BatchingOptions.from_mapping(changes, options)
        model = await asyncio.to_thread(pxrt.load, path, **(load_options or {}))
        if version is not None:
            model.version = str(version)
        if isinstance(model, pxrt.Decoder):
            if options.response_cache:
                await asyncio.to_thread(model.close)
                self.add_decoder(name, model, options)  # (raises, naming the option)
            old = self._decoders.pop(name, None)
            if old is not None:  # replaced: new generations go to the new one at once
                self.metrics.remove_decoder(name, old.version)
            self.add_decoder(name, model, options)
            if old is not None:
                await _retire(old)
            if self.on_models_changed is not None:
                self.on_models_changed()
            return model
        if replace and model.version in self._versions.get(name, {}):
            await self._replace(name, model, options)
        else:
            self.add_model(name, model, options)
        if self.on_models_changed is not None:
            self.on_models_changed()
        return model

    async def _replace(self, name: str, model: Model, options: BatchingOptions) -> None:
        """Serve ``model`` as its version of ``name`` instead of the batcher serving it:
        new requests go to it at once (one assignment on the loop's thread); the old one
        answers what it accepted, then closes, as on ``unload_model``."""
        if self._closed:
            raise ServerClosed("the server is closed")
        versions = self._versions[name]
        batcher = Batcher(
            name, model, self.metrics, options, quiet=self._quiet, cache=self.response_cache
        )
        old = versions[model.version]
        versions[model.version] = batcher
        self._route(name)
        self._closing.add(old)
        task = old.closing()
        task.add_done_callback(functools.partial(self._closed_one, name, model.version, old))
        del old
        await asyncio.shield(task)

    async def unload_model(self, name: str, version: str | None = None) -> None:
        """Stop serving ``version`` of ``name`` (None: every version). New requests for
        it are refused (unversioned ones go to the newest version left) at once; every
        request it accepted is answered; then its pipeline stops and its model (device
        memory included) is released, unless the caller holds it."""
        decoder = self._decoders.get(name)
        if decoder is not None and version in (None, decoder.version):
            del self._decoders[name]
            self.metrics.remove_decoder(name, decoder.version)
            self._changed()
            await _retire(decoder)
            return
        versions = self._versions.get(name)
        if not versions:
            raise no_model(name, self._batchers)
        if version is not None and version not in versions:
            raise no_version(name, version, sorted(versions, key=version_order))
        gone = [version] if version is not None else list(versions)
        batchers = [versions.pop(v) for v in gone]
        self._route(name)
        # The closing goes on if this caller is cancelled; close() waits for it then.
        self._closing.update(batchers)
        closing = []
        for v, batcher in zip(gone, batchers):
            task = batcher.closing()
            task.add_done_callback(functools.partial(self._closed_one, name, v, batcher))
            closing.append(task)
        del batchers, batcher
        await asyncio.shield(asyncio.gather(*closing))
        del closing
        if self.on_models_changed is not None:
            self.on_models_changed()
        else:
            gc.collect()  # the model's reference cycles hold its device memory

    def _closed_one(self, name: str, version: str, batcher: Batcher, _: asyncio.Task) -> None:
        self._closing.discard(batcher)
        self.metrics.remove_model(name, version, batcher)

    @property
    def models(self) -> dict[str, Any]:
        """name -> the model unversioned requests reach (its newest version)."""
        return {name: b.model for name, b in self._batchers.items()}

    @property
    def decoders(self) -> dict[str, Decoder]:
        """name -> a decoder served (``add_decoder``)."""
        return dict(self._decoders)

    def versions(self, name: str) -> list[str]:
        """The versions of ``name`` served, oldest first."""
        if name not in self._versions:
            raise no_model(name, self._batchers)
        return sorted(self._versions[name], key=version_order)

    # ------------------------------------------------------------------ per model

    def model(self, name: str, version: str | None = None) -> Model:
        """The model serving ``version`` of ``name`` (None: the newest); ``UnknownModel``
        when there is none."""
        return self._batcher(name, version).model

    def options(self, name: str, version: str | None = None) -> BatchingOptions:
        """The batching options ``version`` of ``name`` (None: the newest) was given."""
        return self._batcher(name, version).options

    def max_batch_size(self, name: str, version: str | None = None) -> int:
        """The most rows of one batch of ``version`` of ``name``: its option, capped by
        the largest compiled bucket."""
        return self._batcher(name, version).max_batch_size

    def stats(self, name: str, version: str | None = None) -> dict:
        """The metrics snapshot of ``version`` of ``name`` (None: the newest)."""
        batcher = self._batcher(name, version)
        return self.metrics.snapshot_of(name, batcher.model.version)

    def check_health(self, name: str, version: str | None = None) -> None:
        """Raise ``RuntimeError`` when ``version`` of ``name`` cannot serve (closed, or its
        pipeline's workers are gone); ``UnknownModel`` when it is not served."""
        batcher = self._batcher(name, version)
        if batcher.queue.closed:
            raise RuntimeError(f"model {name!r} is closed")
        batcher.pipeline.check_alive()
        batcher.model.check_alive()

    def count(self, name: str, version: str, outcome: str) -> None:
        """A request of ``version`` of ``name`` that a front end answered itself:
        ``invalid`` (it did not follow the protocol) or ``failed`` (an unexpected error).
        A version gone meanwhile counts nothing."""
        batcher = self._versions.get(name, {}).get(version)
        if batcher is not None:
            batcher.count(outcome)

    # ------------------------------------------------------------------ readiness

    def not_serving(self) -> str | None:
        """Why inference requests are refused now (loading, draining), or None."""
        if self._failed is not None:
            return self._failed
        if self.draining:
            return "the server is draining; not accepting inference requests"
        if not self.ready:
            return "the server is loading; not accepting inference requests"
        return None

    @property
    def ready(self) -> bool:
        """Whether it takes inference requests (unless draining)."""
        return self._ready

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value
        self._changed()

    def fail(self, reason: str) -> None:
        """Refuse inference for good, saying ``reason`` (not ready from now on): what a
        multi-host leader does when its group breaks."""
        if self._failed is None:
            self._failed = reason
            self._changed()

    @property
    def draining(self) -> bool:
        """Whether inference requests are refused because the server is stopping."""
        return self._draining.is_set()

    @draining.setter
    def draining(self, value: bool) -> None:
        if value:
            self._draining.set()
        else:
            self._draining.clear()
        self._changed()

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the loop) whenever readiness, draining or the models
        served change (``pxrt serve --workers`` tells its workers)."""
        self._watchers.append(callback)

    def _changed(self) -> None:
        for callback in self._watchers:
            callback()

    def drain(self) -> None:
        """Refuse new inference requests from now on (``not_serving`` says why); the
        accepted ones are answered; open streams stop reading (``wait_draining``).
        ``close`` drains too."""
        self.draining = True

    async def wait_draining(self) -> None:
        """Return once the server drains (at once if it does already)."""
        await self._draining.wait()

    def _batcher(self, name: str, version: str | None = None) -> Batcher:
        """The batcher of ``version`` of ``name`` (None: the newest)."""
        if version is None:
            batcher = self._batchers.get(name)
        else:
            batcher = self._versions.get(name, {}).get(version)
            if batcher is None and name in self._versions:
                raise no_version(name, version, self.versions(name))
        if batcher is None:
            raise no_model(name, self._batchers)
        return batcher

    def infer(
        self,
        name: str,
        request: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        version: str | None = None,
        priority: int = 0,
    ) -> Awaitable[dict]:
        """Queue one request (input name -> array of n >= 1 rows) to be batched with
        others; ``await server.infer("mlp", {"x": x})`` -> output name -> array.

        The request is queued when ``infer`` is called, and the awaitable it returns can
        be awaited, gathered, or made a task (``asyncio.create_task`` takes it like a
        coroutine). Awaiting it raises TypeError or ValueError for a malformed request,
        ``Overloaded`` when the queue was full, ``DeadlineExceeded`` when the deadline
        (``timeout_s``, else the model's default) passed while queued,
        ``ExecutionFailed`` when its batch failed, ``ServerClosed`` while shutting down,
        ``UnknownModel`` for a name (or ``version``) not served. Without a version, the
        newest version served answers. ``priority``: its level (1 the highest, to the
        model's ``priority_levels``; 0: its default). A caller that stops waiting (its task
        cancelled) takes its request out of the queue if it was not dispatched yet.
        """
        try:
            if version is None:
                queue = self._queues.get(name)
                if queue is None:
                    raise no_model(name, self._batchers)
            else:
                queue = self._batcher(name, version).entry
            return queue.submit(request, timeout_s, priority)
        except Exception as exc:  # raised where the caller awaits, as from a coroutine
            return _raise(self._as_served(exc, name, version))

    def submit(
        self,
        name: str,
        request: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        version: str | None = None,
        priority: int = 0,
        trace: Trace | None = None,
    ) -> asyncio.Future:
        """``infer`` without the coroutine: queue the request and return its future at
        once (for callers that handle many requests from one task). Errors that
        ``infer`` raises before queueing are raised here; cancelling the future drops
        the request if it was not dispatched yet. ``trace``: its batches' stages are
        kept there (``serving.tracing``)."""
        try:
            if trace is not None:
                return self._batcher(name, version).submit_traced(
                    request, timeout_s, priority, trace
                )
            return self._batcher(name, version).entry.submit(request, timeout_s, priority).future
        except Exception as exc:
            raise self._as_served(exc, name, version) from None

    def _as_served(self, exc: Exception, name: str, version: str | None) -> Exception:
        """``exc`` naming the model as ``name``: a model's own validation names it as its
        manifest does, and the client knows it by the name it is served as (its
        repository directory, its ``pxrt serve`` name)."""
        if not isinstance(exc, (TypeError, ValueError)) or isinstance(exc, ServingError):
            return exc
        own = self._batcher(name, version).model.name
        if own == name or f"model {own!r}" not in str(exc):
            return exc
        return type(exc)(str(exc).replace(f"model {own!r}", f"model {name!r}", 1))

    def metrics_snapshot(self) -> dict[str, dict]:
        """Per model: request outcomes, batches, stage-time and batch-shape summaries."""
        return self.metrics.snapshot()

    async def close(self) -> None:
        """Stop accepting requests, answer every accepted inference request, stop the
        pipelines; then close the decoders (open generations end with ``ServerClosed``)."""
        self._closed = True
        self.draining = True
        batchers = [b for versions in self._versions.values() for b in versions.values()]
        await asyncio.gather(*(b.close() for b in batchers + list(self._closing)))
        for decoder in self._decoders.values():
            await asyncio.to_thread(decoder.close)
        self.shared_memory.close()


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

    def add_model(
        self, name: str, model: Model, options: BatchingOptions | None = None, **changes: Any
    ) -> None:
        """As ``Server.add_model``."""

        async def add() -> None:
            self._server.add_model(name, model, options, **changes)

        self._call(add())

    def load_model(
        self,
        name: str,
        path: str,
        *,
        load_options: dict | None = None,
        version: str | None = None,
        options: BatchingOptions | None = None,
        **changes: Any,
    ) -> Model:
        """As ``Server.load_model``: load an artifact (``load_options`` go to
        ``pxrt.load``: ``placement``, ``instances``...) and serve it; returns the model."""
        return self._call(
            self._server.load_model(
                name, path, load_options=load_options, version=version, options=options, **changes
            )
        )

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
