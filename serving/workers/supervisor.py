"""``pxrt serve --workers N``: front-end worker processes around one device process.

The device process (``pxrt serve`` itself) owns the models, the batching and the
devices; it binds the listening sockets and starts ``N`` workers (``serving.workers.worker``),
which share them: each accepts, parses and decodes HTTP and gRPC as one ``pxrt serve``
does, and sends what it decoded here over a Unix socket (``serving.workers.ipc``: tensors
inline or through shared memory, never pickled). Everything but inference (metadata,
config, statistics, ``/metrics``, the repository) is answered here by the device
process's own front end, so every worker shows one view of them.

``WorkerLink`` is the device's end of one worker's socket: it queues the requests a
worker sends (``Server.submit``), answers each once its future is done, runs the calls
the worker forwards, and tells the worker whenever readiness, draining or the models
change (``ipc.State``). ``Supervisor`` starts the workers, starts a new one when one
dies (its clients see their connections close, nothing else is lost: its requests in
the queue are cancelled), and stops them when the server drains.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from ..errors import ExecutionFailed, Overloaded, ServerClosed, ServingError
from ..kserve import core
from . import ipc

if TYPE_CHECKING:
    from ..engine.server import Server
    from ..grpc.native import Method

log = logging.getLogger("pxrt.workers")

ARENA_BYTES = 256 << 20  # shared memory per worker and direction (address space until used)
RESTART_DELAY_S = 0.5  # a worker that died is started again after this
MAX_RESTART_S = 30.0  # ... doubled, up to this, while it keeps dying soon after starting
SERVICE = "/inference.GRPCInferenceService/"


def model_state(server: Server, arena: str) -> ipc.State:
    """What a worker needs to know of ``server`` now."""
    served = []
    for name in server.models:
        versions = []
        for version in server.versions(name):
            model = server.model(name, version)
            versions.append(
                ipc.Version(
                    version,
                    [_spec(n, s) for n, s in model.inputs.items()],
                    [_spec(n, s) for n, s in model.outputs.items()],
                    list(model.buckets),
                    {d: list(v) for d, v in model.dim_buckets.items()},
                    core.is_embedding(model),
                )
            )
        served.append(ipc.Served(name, server.model(name).version, versions))
    decoders = [
        ipc.DecoderInfo(
            name,
            decoder.version,
            decoder.artifact.path,
            decoder.artifact.config.get("tokenizer"),
            decoder.chat_template,
        )
        for name, decoder in server.decoders.items()
    ]
    return ipc.State(server.not_serving(), server.draining, served, arena, decoders)


def _spec(name: str, spec: Any) -> ipc.Spec:
    pad = getattr(spec, "pad", 0)
    return ipc.Spec(name, spec.dtype.name, list(spec.shape), pad)


def error_of(exc: BaseException) -> ipc.Error:
    """An exception as it crosses to a worker (``serving.workers.remote`` raises it again): its
    kind in the request core's error table (``core.error_kind``)."""
    retry = exc.retry_after_s if isinstance(exc, Overloaded) else 0.0
    return ipc.Error(core.error_kind(exc), str(exc), retry)


class WorkerLink(ipc.FrameWriter, asyncio.Protocol):
    """The device process's end of one worker's socket."""

    def __init__(self, supervisor: Supervisor, index: int) -> None:
        self.supervisor = supervisor
        self.server = supervisor.server
        self.index = index
        self.reader = ipc.Reader(ipc.ToDevice)
        self.pending: dict[int, asyncio.Future] = {}  # rid -> its future in the queue
        self.generations: dict[int, Any] = {}  # gid -> its pxrt.Generation
        self.tasks: set[asyncio.Task] = set()
        self.theirs: ipc.Arena | None = None  # the worker's: request tensors
        self.ours = ipc.Arena(ARENA_BYTES)  # this side's: answers to this worker
        self._out: list[bytes] = []
        self._flushing = False
        self.transport: Any = None
        self.closed = False
        self.pid = 0

    # ------------------------------------------------------------------ asyncio

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for future in list(self.pending.values()):
            future.cancel()  # out of the queue if not dispatched: nobody reads the answer
        self.pending.clear()
        for gen in list(self.generations.values()):
            gen.cancel()  # nobody reads its tokens: its slot is free for the next step
        self.generations.clear()
        for task in list(self.tasks):
            task.cancel()
        if self.theirs is not None:
            self.theirs.close()
        self.ours.close()
        self.supervisor.lost(self)

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.reader.feed(data)
        except Exception as exc:  # noqa: BLE001 - a worker that speaks garbage is dropped
            log.error("pxrt: worker %d sent a bad message: %s", self.index, exc)
            self.transport.close()
            return
        for message in messages:
            kind = type(message)
            if kind is ipc.Infer:
                self._infer(message)
            elif kind is ipc.Cancel:
                future = self.pending.get(message.rid)
                if future is not None:
                    future.cancel()
            elif kind is ipc.Generate:
                self._generate(message)
            elif kind is ipc.Stop:
                gen = self.generations.get(message.gid)
                if gen is not None:
                    gen.cancel(message.reason)
            elif kind is ipc.Free:
                for offset in message.offsets:
                    self.ours.free(offset)
            elif kind is ipc.Count:
                self.server.count(message.model, message.version, message.outcome)
            elif kind is ipc.Call:
                task = asyncio.ensure_future(self._call(message))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif kind is ipc.Hello:
                self.pid = message.pid
                self.theirs = ipc.Arena.attach(message.arena)
                self.send_state()

    def send_state(self) -> None:
        self.send(model_state(self.server, self.ours.name))

    # ------------------------------------------------------------------ inference

    def _infer(self, message: ipc.Infer) -> None:
        rid = message.rid
        try:
            inputs = {t.name: ipc.from_tensor(t, self.theirs) for t in message.inputs}
            future = self.server.submit(
                message.model, inputs, timeout_s=message.timeout_s, version=message.version,
                priority=message.priority,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - this request's answer
            self.send(ipc.Result(rid, None, error_of(exc)))
            return
        self.pending[rid] = future
        future.add_done_callback(functools.partial(self._done, rid))

    def _done(self, rid: int, future: asyncio.Future) -> None:
        self.pending.pop(rid, None)
        if self.closed:
            return
        if future.cancelled():
            self.send(
                ipc.Result(rid, None, ipc.Error("CancelledError", "the request was cancelled"))
            )
            return
        exc = future.exception()
        if exc is not None:
            self.send(ipc.Result(rid, None, error_of(exc)))
            return
        outputs = [ipc.to_tensor(name, arr, self.ours) for name, arr in future.result().items()]
        self.send(ipc.Result(rid, outputs))

    # ------------------------------------------------------------------ generation

    def _generate(self, message: ipc.Generate) -> None:
        gid = message.gid
        try:
            gen = self.server.start_generation(message.model, message.ids, message.params)
        except Exception as exc:  # noqa: BLE001 - this generation's refusal
            self.send(ipc.Tokens(gid, [], None, error_of(exc)))
            return
        self.generations[gid] = gen
        self.send(ipc.Tokens(gid, []))  # accepted
        task = asyncio.ensure_future(self._relay(gid, gen))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _relay(self, gid: int, gen: Any) -> None:
        """A generation's tokens to the worker as they come (those of one step go out
        in one write with everything else sent in that turn), then its end."""
        error = None
        try:
            scored = gen.logprobs is not None
            prompt = gen.prompt_parts is not None or gen.prompt_logprobs is not None
            async for token in gen:
                n = gen.delivered
                scores = gen.token_logprobs(n - 1, n) if scored else None
                before = gen.prompt_token_logprobs() if prompt and n == 1 else None
                self.send(ipc.Tokens(gid, [token], logprobs=scores, prompt_logprobs=before))
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - its step failed, its decoder closed
            from pxrt.generate import DecoderClosed

            if isinstance(exc, DecoderClosed):  # (as serving.kserve.generation answers them)
                exc = ServerClosed(str(exc))
            elif not isinstance(exc, ServingError):
                exc = ExecutionFailed(str(exc))
            error = error_of(exc)
        finally:
            self.generations.pop(gid, None)
        self.send(ipc.Tokens(gid, [], gen.finish_reason, error))

    # ------------------------------------------------------------------ forwarded calls

    async def _call(self, call: ipc.Call) -> None:
        try:
            reply = await self._answer(call)
        except Exception as exc:  # noqa: BLE001 - a bug: one line, a 500 / INTERNAL
            from ..kserve.core import internal_error

            error = internal_error(f"forwarded {call.kind} {call.method}", exc)
            status = 500 if call.kind == "http" else 13
            body = b'{"error": "internal error"}' if call.kind == "http" else b""
            reply = ipc.Reply(call.cid, status, [], memoryview(body), str(error))
        self.send(reply)

    async def _answer(self, call: ipc.Call) -> ipc.Reply:
        if call.kind == "http":
            status, headers, body = await asgi_call(
                self.supervisor.app, call.method, call.target, call.headers, bytes(call.body)
            )
            return ipc.Reply(call.cid, status, headers, memoryview(body))
        from ..grpc.native import run_method

        method = self.supervisor.methods.get((SERVICE + call.method).encode())
        if method is None or method.impl is None:
            unimplemented = core.GRPC_CODES["UNIMPLEMENTED"]
            return ipc.Reply(
                call.cid, unimplemented, [], memoryview(b""), f"no method {call.method}"
            )
        code, message, body = await run_method(
            method, bytes(call.body), call.headers, call.timeout_s
        )
        return ipc.Reply(call.cid, code, [], memoryview(body), message)


async def asgi_call(
    app: Any, method: str, target: str, headers: list, body: bytes
) -> tuple[int, list, bytes]:
    """One HTTP request through an ASGI app in memory: status, headers, body."""
    path, _, query = target.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": unquote(path),
        "raw_path": path.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "root_path": "",
        "headers": [(bytes(k), bytes(v)) for k, v in headers],
        "client": None,
        "server": None,
    }
    given = False
    never = asyncio.Event()

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the client of a forwarded call does not go away
        return {"type": "http.disconnect"}

    start: dict = {}
    chunks: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return start.get("status", 500), list(start.get("headers", [])), b"".join(chunks)


class Supervisor:
    """Starts ``count`` workers on the listening sockets, keeps them running, and tells
    them what changes on ``server``.

    Args:
      server: the device process's ``Server``.
      app: the device process's KServe v2 ASGI app: it answers what workers forward.
      methods: ``serving.grpc.native.methods`` of its ``GRPCService``: the same, gRPC.
      argv: ``pxrt serve``'s arguments: each worker parses them for its limits.
      sockets: name ("http", "grpc") -> listening socket the workers share.
    """

    def __init__(
        self,
        server: Server,
        app: Any,
        methods: dict[bytes, Method],
        argv: list[str],
        count: int,
        sockets: dict[str, socket.socket],
    ) -> None:
        self.server = server
        self.app = app
        self.methods = methods
        self.argv = argv
        self.count = count
        self.sockets = sockets
        self.links: dict[int, WorkerLink] = {}
        self.procs: dict[int, Any] = {}  # index -> its subprocess.Popen (or _Dead)
        self.stopping = False
        self.restarts = 0
        self._started: dict[int, float] = {}  # index -> when its worker started
        self._delay: dict[int, float] = {}  # index -> its restart delay now
        self._not_before: dict[int, float] = {}  # index -> no restart before then
        self._watch: asyncio.Task | None = None
        server.watch(self._changed)

    def _changed(self) -> None:
        for link in list(self.links.values()):
            link.send_state()

    async def start(self) -> None:
        for index in range(self.count):
            await self._spawn(index)
        self._watch = asyncio.ensure_future(self._watch_workers())

    async def _spawn(self, index: int) -> None:
        ours, theirs = socket.socketpair()
        fds = {name: sock.fileno() for name, sock in self.sockets.items()}
        cmd = [
            sys.executable, "-m", "serving.workers.worker",
            "--ipc-fd", str(theirs.fileno()),
            *[f"--{name}-fd={fd}" for name, fd in fds.items()],
            "--index", f"{index}/{self.count}",
            "--", *self.argv,
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno(), *fds.values()])
        theirs.close()
        self.procs[index] = proc
        self._started[index] = asyncio.get_running_loop().time()
        loop = asyncio.get_running_loop()
        _, link = await loop.connect_accepted_socket(lambda: WorkerLink(self, index), ours)
        self.links[index] = link

    def lost(self, link: WorkerLink) -> None:
        if self.links.get(link.index) is link:
            del self.links[link.index]

    async def _watch_workers(self) -> None:
        """Start a worker again when one dies (its link closes when it does); one that
        keeps dying soon after starting is started again less and less often."""
        loop = asyncio.get_running_loop()
        while not self.stopping:
            await asyncio.sleep(RESTART_DELAY_S)
            now = loop.time()
            for index, proc in list(self.procs.items()):
                if proc.poll() is None or self.stopping or now < self._not_before.get(index, 0):
                    continue
                lived = now - self._started.get(index, now)
                delay = self._delay.get(index, RESTART_DELAY_S)
                delay = RESTART_DELAY_S if lived > 10 * delay else min(2 * delay, MAX_RESTART_S)
                self._delay[index] = delay
                log.error(
                    "pxrt: worker %d (pid %d) exited with %s after %.1f s; starting another",
                    index, proc.pid, proc.returncode, lived,
                )  # fmt: skip
                link = self.links.pop(index, None)
                if link is not None and link.transport is not None:
                    link.transport.close()
                self.restarts += 1
                if lived < 5:
                    self._not_before[index] = now + delay
                    self.procs[index] = _Dead(proc.returncode)
                    continue
                await self._spawn(index)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to every worker (each stops accepting, answers what it accepted, and
        exits), then wait for them; any left after ``grace_s`` is killed."""
        self.stopping = True
        if self._watch is not None:
            self._watch.cancel()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(p.poll() is None for p in self.procs.values()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for proc in self.procs.values():
            if proc.poll() is None:
                log.error("pxrt: worker pid %d did not stop in time; killed", proc.pid)
                proc.kill()
                proc.wait()
        for link in list(self.links.values()):
            if link.transport is not None:
                link.transport.close()
            link.ours.close()  # (again in connection_lost: closing twice is harmless)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]


class _Dead:
    """A worker that died soon after starting, waiting to be started again."""

    pid = 0

    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


__all__ = ["Supervisor", "WorkerLink", "asgi_call", "model_state"]
