"""A front-end worker's view of the device process (``pxrt serve --workers N``).

``RemoteServer`` is what a worker's front ends (the native HTTP path, the ASGI app's
inference endpoint, gRPC on pxrt's HTTP/2) call where one ``pxrt serve`` process calls
its ``Server``: readiness and draining, the models served (enough of each to decode
its requests: ``RemoteModel``), ``submit`` and ``count``. It keeps what the device
process last said (``ipc.State``) and sends each request there (``ipc.Infer``); its
future resolves when the answer comes back, with the same errors ``Server.submit``'s
future would have. Everything else a client asks (metadata, config, statistics,
``/metrics``, the repository) is forwarded whole and answered by the device process
(``ForwardApp`` for HTTP, ``forward_grpc`` for gRPC).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from pxrt.decoder.params import SamplingParams
from pxrt.finish import CANCELLED, ERROR

from ..errors import ServerClosed, no_model, no_version
from ..kserve import core
from ..kserve.shm import WORKERS, SharedMemory
from ..options import GenerationLimits
from . import ipc

log = logging.getLogger("pxrt.worker")

ARENA_BYTES = 256 << 20  # this worker's shared memory for request tensors


class RemoteModel:
    """A version of a model as a worker knows it: its name, version, and its inputs'
    and outputs' specs (``ipc.Spec``: name, dtype, shape) by name."""

    def __init__(self, name: str, version: ipc.Version) -> None:
        self.name = name
        self.version = version.version
        self.inputs = {s.name: s for s in version.inputs}
        self.outputs = {s.name: s for s in version.outputs}
        self.buckets = tuple(version.buckets)
        self.dim_buckets = {d: tuple(v) for d, v in version.dim_buckets.items()}
        self.embedding = version.embedding
        self.described = version

    def __repr__(self) -> str:
        return f"RemoteModel({self.name!r}, version {self.version!r})"


class DeviceGone(ServerClosed):
    """The device process is gone (this worker stops)."""


class RemoteDecoder:
    """A decoder as a worker knows it: what its front ends need to tokenize prompts,
    render chats and detokenize what comes back (the generation runs in the device
    process)."""

    def __init__(self, info: ipc.DecoderInfo) -> None:
        from pxrt import tokenizer

        self.name = info.name
        self.version = info.version
        self.tokenizer = tokenizer.load(info.tokenizer, info.path)
        self.chat_template = info.chat_template
        self.described = info

    def __repr__(self) -> str:
        return f"RemoteDecoder({self.name!r}, version {self.version!r})"


class RemoteGeneration:
    """A generation running in the device process, as ``pxrt.Generation`` looks to the
    front ends: ``async for`` its tokens, ``cancel``, then ``finish_reason``, ``error``,
    ``prompt`` and ``delivered``."""

    __slots__ = ("gid", "prompt", "tokens", "finish_reason", "error", "delivered", "_link",
                 "_waiter", "_accepted", "_loop", "listener", "logprobs",
                 "prompt_logprobs")  # fmt: skip

    def __init__(self, gid: int, prompt: list[int], link: DeviceLink) -> None:
        self.gid = gid
        self.prompt = prompt
        self.tokens: list[int] = []
        self.logprobs: list = []  # with logprobs: as the device process sent them
        self.prompt_logprobs: list | None = None  # with prompt_logprobs: the same
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.delivered = 0  # tokens its reader has taken
        self._link: DeviceLink | None = link
        self._waiter: asyncio.Future | None = None
        self._loop = link.loop
        self._accepted = link.loop.create_future()
        self.listener: Any = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self, reason: str = CANCELLED) -> None:
        """End it with ``reason`` (no-op when it ended): the device process frees its
        slot; tokens still on their way are dropped."""
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        if self._link is not None:
            self._link.send(ipc.Stop(self.gid, reason))
        self._link = None
        self._loop.call_soon(self._wake)  # (not from inside a listener that cancels)

    def _end(self) -> None:
        self._link = None
        self._wake()

    def _wake(self) -> None:
        if self.listener is not None:
            try:
                self.listener(self)
            except Exception:  # noqa: BLE001 - one reader's bug: the others go on
                log.exception("pxrt: a generation's listener failed")
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def listen(self, callback: Any) -> None:
        """As ``pxrt.Generation.listen``: ``callback(self)`` on each news."""
        self.listener = callback
        if self.delivered < len(self.tokens) or self.finish_reason is not None:
            asyncio.get_running_loop().call_soon(self._wake)

    def take(self) -> list[int]:
        tokens = self.tokens[self.delivered :]
        self.delivered += len(tokens)
        return tokens

    def token_logprobs(self, start: int, stop: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """As ``pxrt.Generation.token_logprobs``."""
        return [(lp, [(t, v) for t, v in top]) for lp, top in self.logprobs[start:stop]]

    def prompt_token_logprobs(self) -> list[tuple[float, list[tuple[int, float]]] | None] | None:
        """As ``pxrt.Generation.prompt_token_logprobs``."""
        if self.prompt_logprobs is None:
            return None
        return [
            None if row is None else (row[0], [(t, v) for t, v in row[1]])
            for row in self.prompt_logprobs
        ]

    def on_tokens(self, message: ipc.Tokens) -> bool:
        """News from the device process; True once it has ended."""
        if not self._accepted.done():
            if message.error is not None and message.finish_reason is None:
                self._accepted.set_exception(_error(message.error))
                return True
            self._accepted.set_result(None)
        if self.finish_reason is not None:  # cancelled here: what still came is dropped
            return message.finish_reason is not None
        if message.logprobs:
            self.logprobs += message.logprobs
        if message.prompt_logprobs is not None:
            self.prompt_logprobs = message.prompt_logprobs
        self.tokens += message.tokens
        if message.finish_reason is not None:
            self.finish_reason = message.finish_reason
            if message.error is not None:
                self.error = _error(message.error)
            self._end()
            return True
        self._wake()
        return False

    def fail(self, exc: BaseException) -> None:
        """The device process is gone."""
        if not self._accepted.done():
            self._accepted.set_exception(exc)
        if self.finish_reason is None:
            self.finish_reason, self.error = ERROR, exc
        self._end()

    async def accepted(self) -> None:
        await self._accepted

    def __aiter__(self) -> RemoteGeneration:
        return self

    async def __anext__(self) -> int:
        while True:
            if self.delivered < len(self.tokens):
                self.delivered += 1
                return self.tokens[self.delivered - 1]
            if self.finish_reason is not None:
                if self.error is not None:
                    raise self.error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                self._waiter = None


def _error(error: ipc.Error) -> BaseException:
    """An error from the device process, as ``Server.submit``'s future would raise it."""
    return core.error_of_kind(error.kind, error.message, error.retry_after_s)


class RemoteServer:
    """What a worker's front ends call instead of ``serving.Server`` (see the module)."""

    def __init__(
        self, generation_limits: GenerationLimits = GenerationLimits(), tracing: Any = None
    ) -> None:
        self.generation_limits = generation_limits  # (checked here: parsed in the worker)
        #: This worker's tracing (its spans: decode, the wait for the device process's
        #: answer, encode), or None.
        self.tracing = tracing
        self.shared_memory = SharedMemory(unavailable=WORKERS)
        self.link: DeviceLink | None = None
        self._why: str | None = "the server is starting; not accepting inference requests"
        self._draining = asyncio.Event()
        self._models: dict[str, dict[str, RemoteModel]] = {}  # name -> version -> model
        self._newest: dict[str, str] = {}
        self._pending: dict[int, tuple[asyncio.Future, list[int]]] = {}  # rid -> (future, shm)
        self._calls: dict[int, asyncio.Future] = {}
        self._generations: dict[int, RemoteGeneration] = {}
        self._decoders: dict[str, RemoteDecoder] = {}
        self._next = 0
        self.arena = ipc.Arena(ARENA_BYTES)  # request tensors
        self.theirs: ipc.Arena | None = None  # the device's: answers
        self.started = asyncio.Event()  # the first State came

    # ------------------------------------------------------------------ what Server offers

    def not_serving(self) -> str | None:
        return self._why

    def is_decoder(self, name: str) -> bool:
        return name in self._decoders

    @property
    def decoders(self) -> dict[str, RemoteDecoder]:
        return dict(self._decoders)

    def decoder(self, name: str) -> RemoteDecoder:
        decoder = self._decoders.get(name)
        if decoder is None:
            raise no_model(name, list(self._decoders))
        return decoder

    async def open_generation(
        self,
        name: str,
        prompt: list[int],
        params: SamplingParams | None = None,
        **options: Any,
    ) -> RemoteGeneration:
        """Start a generation in the device process once it has accepted it (its
        refusal raised here, as ``Server.start_generation`` raises it). ``params`` or
        ``options`` (as for ``pxrt.Decoder.submit``) are checked here, before they
        cross to the device process; what depends on the model is checked there."""
        link = self.link
        if link is None:
            raise DeviceGone("the device process is gone")
        self.decoder(name)  # UnknownModel here
        params = SamplingParams.resolve(params, options)
        gid = self._next = self._next + 1
        gen = RemoteGeneration(gid, list(prompt), link)
        self._generations[gid] = gen
        link.send(ipc.Generate(gid, name, gen.prompt, params))
        try:
            await gen.accepted()
        except BaseException:
            self._generations.pop(gid, None)
            gen.cancel()
            raise
        return gen

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    async def wait_draining(self) -> None:
        await self._draining.wait()

    @property
    def models(self) -> dict[str, RemoteModel]:
        return {name: self._models[name][v] for name, v in self._newest.items()}

    def versions(self, name: str) -> list[str]:
        if name not in self._models:
            raise no_model(name, list(self._newest))
        return list(self._models[name])

    def model(self, name: str, version: str | None = None) -> RemoteModel:
        versions = self._models.get(name)
        if versions is None:
            raise no_model(name, list(self._newest))
        if version is None:
            return versions[self._newest[name]]
        model = versions.get(version)
        if model is None:
            raise no_version(name, version, list(versions))
        return model

    def count(self, name: str, version: str, outcome: str) -> None:
        if self.link is not None:
            self.link.send(ipc.Count(name, version, outcome))

    def submit(
        self,
        name: str,
        request: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        version: str | None = None,
        priority: int = 0,
        trace: Any = None,
    ) -> asyncio.Future:
        """Send a request to the device process's queue; its future resolves with the
        outputs (or its error). Cancelling it (a client that hung up) takes the request
        out of the queue there if it was not dispatched yet. (A ``trace`` gets no batch
        stages: they happen in the device process.)"""
        link = self.link
        if link is None:
            raise DeviceGone("the device process is gone")
        self.model(name, version)  # UnknownModel here, as Server.submit raises it
        rid = self._next = self._next + 1
        offsets: list[int] = []
        tensors = []
        for key, arr in request.items():
            tensor = ipc.to_tensor(key, np.asarray(arr), self.arena)
            if tensor.offset >= 0:
                offsets.append(tensor.offset)
            tensors.append(tensor)
        future = link.loop.create_future()
        self._pending[rid] = (future, offsets)
        future.add_done_callback(functools.partial(self._cancelled, rid))
        link.send(ipc.Infer(rid, name, version, timeout_s, tensors, priority))
        return future

    def _cancelled(self, rid: int, future: asyncio.Future) -> None:
        if future.cancelled() and rid in self._pending and self.link is not None:
            self.link.send(ipc.Cancel(rid))  # (its shared memory is freed with its Result)

    # ------------------------------------------------------------------ from the device

    def on_state(self, state: ipc.State) -> None:
        models: dict[str, dict[str, RemoteModel]] = {}
        for served in state.models:
            old = self._models.get(served.name, {})
            versions = {}
            for described in served.versions:
                kept = old.get(described.version)
                # The same object while it is the same: request plans are kept per model.
                same = kept is not None and kept.described == described
                versions[described.version] = (
                    kept if same and kept is not None else RemoteModel(served.name, described)
                )
            models[served.name] = versions
        self._models = models
        self._newest = {s.name: s.newest for s in state.models}
        decoders: dict[str, RemoteDecoder] = {}
        for info in state.decoders:
            had = self._decoders.get(info.name)  # (its tokenizer is loaded once)
            same = had is not None and had.described == info
            decoders[info.name] = had if same and had is not None else RemoteDecoder(info)
        self._decoders = decoders
        self._why = state.not_serving
        if state.draining:
            self._draining.set()
        if self.theirs is None or self.theirs.name != state.arena:
            self.theirs = ipc.Arena.attach(state.arena)
        self.started.set()

    def on_result(self, result: ipc.Result) -> None:
        entry = self._pending.pop(result.rid, None)
        theirs = [t.offset for t in result.outputs or () if t.offset >= 0]
        if entry is None:
            if theirs and self.link is not None:
                self.link.send(ipc.Free(theirs))
            return
        future, ours = entry
        for offset in ours:
            self.arena.free(offset)
        if future.done():
            if theirs and self.link is not None:
                self.link.send(ipc.Free(theirs))
            return
        if result.error is not None:
            if result.error.kind == "CancelledError":
                future.cancel()  # (its model closed under it: answered as cancelled)
            else:
                future.set_exception(_error(result.error))
            return
        outputs = {}
        for tensor in result.outputs or ():
            arr = ipc.from_tensor(tensor, self.theirs)
            # Out of shared memory before the reply: a transport may keep a buffer
            # until the socket takes it, and the device reuses the space once freed.
            outputs[tensor.name] = arr.copy() if tensor.offset >= 0 else arr
        if theirs and self.link is not None:
            self.link.send(ipc.Free(theirs))
        future.set_result(outputs)

    def on_tokens(self, message: ipc.Tokens) -> None:
        gen = self._generations.get(message.gid)
        if gen is not None and gen.on_tokens(message):
            del self._generations[message.gid]

    def on_reply(self, reply: ipc.Reply) -> None:
        future = self._calls.pop(reply.cid, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def on_lost(self) -> None:
        """The device process is gone: every request waiting on it fails."""
        self.link = None
        self._why = "the device process is gone; not accepting inference requests"
        gone = DeviceGone("the device process is gone")
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(gone)
        self._pending.clear()
        for call in self._calls.values():
            if not call.done():
                call.set_exception(gone)
        self._calls.clear()
        for gen in self._generations.values():
            gen.fail(gone)
        self._generations.clear()
        self._draining.set()

    def close(self) -> None:
        """Give back the shared memory (this worker's, and its view of the device's)."""
        if self.link is not None and self.link.transport is not None:
            self.link.transport.close()
        self.arena.close()
        if self.theirs is not None:
            self.theirs.close()

    # ------------------------------------------------------------------ forwarded calls

    async def call(self, message: ipc.Call) -> ipc.Reply:
        link = self.link
        if link is None:
            raise DeviceGone("the device process is gone")
        cid = self._next = self._next + 1
        message.cid = cid
        future = link.loop.create_future()
        self._calls[cid] = future
        link.send(message)
        try:
            return await future
        finally:
            self._calls.pop(cid, None)

    async def forward_grpc(
        self, method: Any, data: bytes, headers: list, remaining: float | None
    ) -> tuple[int, str, bytes]:
        """A gRPC method other than inference, answered by the device process (as
        ``serving.grpc.native.run_method`` there)."""
        metadata = [(k, v) for k, v in headers if not k.startswith(b":")]
        try:
            reply = await self.call(
                ipc.Call(0, "grpc", method.name, "", metadata, memoryview(data), remaining)
            )
        except DeviceGone as exc:
            return core.GRPC_CODES["UNAVAILABLE"], str(exc), b""
        return reply.status, reply.message, bytes(reply.body)


class DeviceLink(ipc.FrameWriter, asyncio.Protocol):
    """A worker's end of its socket to the device process."""

    def __init__(self, remote: RemoteServer, on_lost: Any = None) -> None:
        self.remote = remote
        self.reader = ipc.Reader(ipc.ToWorker)
        self.on_lost = on_lost
        self._out: list[bytes] = []
        self._flushing = False
        self.closed = False
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.remote.link = self
        self.send(ipc.Hello(os.getpid(), self.remote.arena.name))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.remote.on_lost()
        if self.on_lost is not None:
            self.on_lost()

    def data_received(self, data: bytes) -> None:
        remote = self.remote
        for message in self.reader.feed(data):
            kind = type(message)
            if kind is ipc.Result:
                remote.on_result(message)
            elif kind is ipc.Tokens:
                remote.on_tokens(message)
            elif kind is ipc.Reply:
                remote.on_reply(message)
            elif kind is ipc.State:
                remote.on_state(message)


class ForwardApp:
    """The ASGI app behind a worker's inference endpoint: any other request is read
    (within the body limit) and answered by the device process's own app."""

    def __init__(self, remote: RemoteServer, max_body_bytes: int) -> None:
        self.remote = remote
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _reply(send, 413, b'{"error": "the request body is over the limit"}')
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        call = ipc.Call(
            0, "http", scope["method"], target.decode("latin-1"),
            list(scope["headers"]), memoryview(b"".join(chunks)),
        )  # fmt: skip
        try:
            reply = await self.remote.call(call)
        except DeviceGone:
            await _reply(send, 503, b'{"error": "the device process is gone"}')
            return
        await send(
            {"type": "http.response.start", "status": reply.status, "headers": reply.headers}
        )
        await send({"type": "http.response.body", "body": bytes(reply.body)})


async def _reply(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = [
    "DeviceGone",
    "DeviceLink",
    "ForwardApp",
    "RemoteDecoder",
    "RemoteGeneration",
    "RemoteModel",
    "RemoteServer",
]
