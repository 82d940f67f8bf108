"""Multi-host serving: one SPMD program over the devices of several processes.

``pxrt.load(path, distributed=Distributed(coordinator, num_processes, process_id))`` in
every process of a group: each joins jax's distributed runtime (``jax.distributed``;
gloo collectives on CPU), loads the same artifact onto the global mesh (the batch
sharded over every process's devices, params replicated on each) and compiles every
cell. Process 0, the **leader**, gets a ``Model`` whose batches run in lockstep on the
whole group; every other process, a **follower**, gets a ``Follower`` whose ``follow()``
replays the leader's batches until the leader stops.

Lockstep (one TCP connection from each follower to the leader, ``control_port``):

- Joining is authenticated both ways with the group's shared secret (``Distributed``'s
  ``secret``, ``$PXRT_GROUP_SECRET``, or ``pxrt serve --group-secret-file``): the
  leader sends a fresh nonce, the follower answers with its own and an HMAC-SHA256 over
  both nonces, its process id and the artifact's fingerprint, and the leader answers
  with an HMAC the other way. A peer that cannot prove it holds the secret is logged and
  ignored (the group waits on for its real follower), and each hello is read on its own
  thread with a short timeout, so a silent connection holds nothing up. The channel is
  authenticated, not encrypted: run a group on a network its hosts own.

- For each batch the leader sends each follower a fixed header (magic, sequence number,
  cell, payload bytes) and the rows of the batch that follower's devices hold, then
  starts the same executable on its own rows. Headers go out and local executions start
  under one lock, so every process runs the same programs in the same order (jax's
  multi-controller rule), whatever the number of batches in flight.
- A follower checks the sequence number (one more than the last) and the payload size of
  every step, runs the cell, and answers with the same sequence number and the rows of
  every output its devices computed. The leader puts the batch's outputs together from
  its own shards and the answers. Outputs stay sharded by rows: no collective in the
  program unless the model has one (``docs/multihost.md`` has the measurements that chose
  this over a replicated output or Saxml's leader data plus zeros).
- A follower that goes away (its connection closes), answers out of order, reports an
  error or does not answer within ``step_timeout_s`` breaks the group: every batch in
  flight fails with ``GroupBroken``, the model reports it (``Model.check_alive``, and
  ``pxrt serve`` turns not-ready and refuses inference), and nothing runs on the group
  again. Restart every process of the group to serve again.
- A follower whose leader goes away stops with ``LeaderGone`` (``pxrt serve`` exits 3)
  instead of waiting for jax's heartbeat timeout.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import logging
import math
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

log = logging.getLogger("pxrt")

#: leader -> follower, before each step: magic, sequence number, cell, payload bytes.
HEADER = struct.Struct("<4sQIQ")
#: follower -> leader, after each step: magic, sequence number, status, payload bytes.
REPLY = struct.Struct("<4sQBQ")
#: either way, at connection: magic, bytes of the JSON that follows.
HELLO = struct.Struct("<4sI")
_STEP, _ANSWER, _HELLO = b"PXST", b"PXRE", b"PXHI"
#: the cell of the header that tells followers the group stops.
STOP = 0xFFFFFFFF
_OK, _FAILED = 0, 1
#: The largest answer a leader reads (a follower's rows of every output of a batch).
_MOST_ANSWER = 1 << 36
#: The environment variable that holds a group's shared secret (``Distributed.secret``).
SECRET_ENV = "PXRT_GROUP_SECRET"
MIN_SECRET = 16  # characters: ``openssl rand -hex 32`` gives 64
HELLO_TIMEOUT_S = 10.0  # a connection to the leader's port must say hello within this
MOST_HELLOS = 32  # connections the leader hears out at once (more are closed at once)


class GroupBroken(RuntimeError):
    """The group cannot run batches any more: a follower went away, stalled, failed or
    answered out of order. Restart every process of the group."""


class LeaderGone(RuntimeError):
    """A follower's leader went away (or sent something a leader would not)."""


@dataclasses.dataclass(frozen=True)
class Distributed:
    """Where a process stands in a multi-host group (``pxrt.load(distributed=...)``).

    Args:
      coordinator: ``host:port`` of jax's coordination service, which process 0 runs;
        every process gives the same one.
      num_processes: processes in the group.
      process_id: this process's index; 0 is the leader.
      control_port: the leader's lockstep port on the coordinator's host (default: the
        coordinator's port + 1).
      connect_timeout_s: how long the leader waits for every follower to connect, and a
        follower for the leader, after each has compiled.
      step_timeout_s: how long the leader waits for a follower's answer to one batch
        before it breaks the group (a stalled follower).
      secret: the group's shared secret (the same in every process; at least 16
        characters): followers and leader prove to each other they hold it when they
        join. Default: ``$PXRT_GROUP_SECRET``; a group of more than one process needs
        one.
    """

    coordinator: str
    num_processes: int
    process_id: int
    control_port: int | None = None
    connect_timeout_s: float = 300.0
    step_timeout_s: float = 30.0
    secret: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"distributed: coordinator must be host:port, got {self.coordinator!r}"
            )
        for name in ("num_processes", "process_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"distributed: {name} must be an int >= 0, got {value!r}")
        if self.num_processes < 1 or self.process_id >= self.num_processes:
            raise ValueError(
                f"distributed: process_id must be in [0, num_processes), got process_id "
                f"{self.process_id} of num_processes {self.num_processes}"
            )
        if self.control_port is not None and not 0 < self.control_port < 65536:
            raise ValueError(f"distributed: control_port must be a port, got {self.control_port}")
        for name in ("connect_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"distributed: {name} must be > 0, got {getattr(self, name)}")
        secret = self.secret if self.secret is not None else os.environ.get(SECRET_ENV)
        if self.num_processes > 1 and (secret is None or len(secret.strip()) < MIN_SECRET):
            raise ValueError(
                f"distributed: a group of {self.num_processes} processes needs a shared secret "
                f"of at least {MIN_SECRET} characters, the same in every process, so that "
                f"only its members join it: set ${SECRET_ENV} (pxrt serve: or "
                "--group-secret-file; pxrt.load: Distributed(secret=...)), e.g. the output of "
                "`openssl rand -hex 32`"
            )
        object.__setattr__(self, "secret", None if secret is None else secret.strip())

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    @property
    def control_address(self) -> tuple[str, int]:
        host, _, port = self.coordinator.rpartition(":")
        host = host.strip("[]")
        return host, self.control_port or int(port) + 1


def initialize(cfg: Distributed) -> None:
    """Join jax's distributed runtime as ``cfg`` says (once per process, before jax
    touches a device). On CPU, collectives go over gloo. Recoverable tasks: a follower
    that dies does not take the leader down (the leader reports it instead). Nothing
    else of jax's config is changed (``pxrt serve``, which drains on SIGTERM, turns
    jax's preemption service off itself: it would take the signal)."""
    import jax

    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (cfg.num_processes, cfg.process_id):
            raise RuntimeError(
                f"distributed: jax already runs as process {jax.process_index()} of "
                f"{jax.process_count()}; asked for {cfg.process_id} of {cfg.num_processes}"
            )
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    try:
        jax.distributed.initialize(
            cfg.coordinator,
            cfg.num_processes,
            cfg.process_id,
            initialization_timeout=max(1, int(cfg.connect_timeout_s)),
            shutdown_timeout_seconds=10,
        )
    except RuntimeError as exc:
        raise RuntimeError(
            f"distributed: process {cfg.process_id} of {cfg.num_processes} could not join "
            f"the group at {cfg.coordinator}: {exc} (jax.distributed must start before "
            "anything uses a jax device in this process)"
        ) from exc


# --------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which rows of a cell's batch each process's devices hold (the batch is sharded
    over the global mesh; each process's rows are contiguous)."""

    size: int
    #: process index -> its rows
    rows: dict[int, slice]
    #: this process's index
    process: int
    #: rows per device
    per_device: int

    @classmethod
    def of(cls, sharding: Any, size: int, process: int) -> Layout:
        index = sharding.devices_indices_map((size,))
        spans: dict[int, list[slice]] = {}
        for device, (rows,) in index.items():
            spans.setdefault(device.process_index, []).append(slice(*rows.indices(size)[:2]))
        merged = {}
        for p, slices in spans.items():
            slices.sort(key=lambda s: s.start)
            if any(a.stop != b.start for a, b in zip(slices, slices[1:])):
                raise ValueError(f"process {p}'s rows of the batch are not contiguous: {slices}")
            merged[p] = slice(slices[0].start, slices[-1].stop)
        return cls(size, merged, process, size // len(index))


def _global_arrays(local: Sequence[np.ndarray], size: int, sharding: Any) -> list:
    """This process's rows of each input (``local``) as global jax arrays of the whole
    ``size``-row batch (jax's public way; 2.4x faster here than a ``device_put`` per
    device and ``make_array_from_single_device_arrays``)."""
    import jax

    return [
        jax.make_array_from_process_local_data(sharding, buf, (size,) + buf.shape[1:])
        for buf in local
    ]


class LocalPart:
    """One process's part of a cell: its rows onto its devices, the launch, its output
    rows back; through the raw path one process takes (``pxrt._xla.RawProgram``) when
    it gives this process the same bits as jax's public path on ``example`` (its rows
    of the example inputs), else through the public path. Every process checks its own
    part, in the same order."""

    def __init__(
        self,
        compiled: Any,
        params_dev: Any,
        layout: Layout,
        sharding: Any,
        x64: bool,
        example: Sequence[np.ndarray],
    ) -> None:
        import jax

        from . import _xla

        self.compiled = compiled
        self.params_dev = params_dev
        self.size = layout.size
        self.sharding = sharding
        self.x64 = x64
        self.raw: Any = None
        self.path = "public"
        want = self.rows(self.launch(example))
        if not _xla.RAW_PATH_AVAILABLE:
            return
        try:
            raw = _xla.RawProgram(
                compiled,
                jax.tree.leaves(params_dev),
                len(example),
                x64,
                layout.size,
                zero_copy=False,
            )
            base = raw.first_row
            self._slices = [slice(r.start - base, r.stop - base) for r in raw.row_slices]
            self.raw = raw
            got = self.rows(self.launch(example))
        except Exception as exc:  # noqa: BLE001 - any failure means: not this path
            self.raw = None
            log.info("pxrt: multi-host cell %d uses the public path: %r", layout.size, exc)
            return
        if all(
            len(g) == len(w) and all(_xla._same_bits(a, b) for a, b in zip(g, w))
            for g, w in zip(got, want)
        ):
            self.path = "raw"
        else:
            self.raw = None
            log.warning(
                "pxrt: multi-host cell %d: the raw path differs; the public one runs", layout.size
            )

    def launch(self, local: Sequence[np.ndarray]) -> Any:
        """Start this process's part on its rows of each input (``local``)."""
        from . import _xla

        if self.raw is not None:
            return self.raw.dispatch(_xla.StagingSlot(list(local), self._slices))
        arrays = _global_arrays(local, self.size, self.sharding)
        with _xla.x64_scope(self.x64):
            return self.compiled(self.params_dev, *arrays)

    def rows(self, handle: Any) -> list[list[np.ndarray]]:
        """Per output, this process's shards in row order, on the host."""
        if self.raw is not None:
            return self.raw.fetch(handle)
        return [local_rows(o) for o in handle]


def local_rows(out: Any) -> list[np.ndarray]:
    """This process's shards of one row-sharded output, in row order, on the host."""
    shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start or 0)
    return [np.asarray(s.data) for s in shards]


# --------------------------------------------------------------------------- sockets


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return buf


def _bytes_of(part: Any) -> memoryview:
    """A flat byte view of ``part``: bytes, or a C-contiguous numpy array of any dtype
    (ml_dtypes' bfloat16 and float8 do not export the buffer protocol: viewed as uint8)."""
    if isinstance(part, np.ndarray):
        part = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
    return memoryview(part).cast("B")


_MOST_BUFFERS = 512  # per sendmsg (IOV_MAX is 1024 on Linux)


def _send(sock: socket.socket, parts: Sequence[Any]) -> None:
    """Send every buffer of ``parts``, in order, in as few system calls as it takes."""
    views = [v for v in map(_bytes_of, parts) if len(v)]
    _send_views(sock, views)


def _send_framed(sock: socket.socket, header: Callable[[int], bytes], parts: Sequence[Any]) -> None:
    """Send ``header(n)`` then ``parts``, ``n`` being their bytes (each viewed once)."""
    views = [v for v in map(_bytes_of, parts) if len(v)]
    _send_views(sock, [header(sum(map(len, views))), *views])


def _send_views(sock: socket.socket, views: list) -> None:
    while views:
        sent = sock.sendmsg(views[:_MOST_BUFFERS])
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


def _send_json(sock: socket.socket, doc: dict) -> None:
    body = msgspec.json.encode(doc)
    _send(sock, [HELLO.pack(_HELLO, len(body)), body])


def _recv_json(sock: socket.socket) -> dict:
    magic, n = HELLO.unpack(_recv_exact(sock, HELLO.size))
    if magic != _HELLO or n > 1 << 24:
        raise ConnectionError("not a pxrt group hello")
    return msgspec.json.decode(bytes(_recv_exact(sock, n)))


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _send_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound how long one send may block (a peer that stopped reading: its socket's
    buffers full) without bounding receives: the kernel's ``SO_SNDTIMEO``; a send that
    runs out raises ``BlockingIOError``."""
    whole = int(seconds)
    sock.setsockopt(
        socket.SOL_SOCKET,
        socket.SO_SNDTIMEO,
        struct.pack("ll", whole, int((seconds - whole) * 1e6)),
    )


def _mac(cfg: Distributed, *parts: str) -> str:
    assert cfg.secret is not None
    message = "\0".join(parts).encode()
    return hmac.new(cfg.secret.encode(), message, hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class Hello:
    """A peer's hello that checked out: the process it says it is, its fingerprint, and
    the nonces (the peer's, the leader's) the leader's answer covers."""

    process: Any
    fingerprint: str
    nonces: tuple[str, str]


def greet_follower(sock: socket.socket, cfg: Distributed) -> Hello:
    """The leader's side of a hello on ``sock``: a challenge, then the peer's answer,
    checked. Raises ``PermissionError`` for a peer that does not hold the group's secret
    (after telling it so) and ``ConnectionError`` or ``ValueError`` for one that does not
    speak the protocol. The leader answers a member with ``welcome``."""
    nonce = secrets.token_hex(16)
    _send_json(sock, {"nonce": nonce})
    hello = _recv_json(sock)
    process = hello.get("process_id")
    theirs, peer_nonce, mac = (hello.get(k) for k in ("fingerprint", "nonce", "mac"))
    if not (isinstance(theirs, str) and isinstance(peer_nonce, str) and isinstance(mac, str)):
        raise ValueError("not a pxrt group hello")
    want = _mac(cfg, "follower", nonce, peer_nonce, str(process), theirs)
    if not hmac.compare_digest(mac, want):
        _send_json(sock, {"ok": False, "error": "it does not hold the group's secret"})
        raise PermissionError("it does not hold the group's secret")
    return Hello(process, theirs, (peer_nonce, nonce))


def welcome(sock: socket.socket, cfg: Distributed, hello: Hello, why: str | None) -> None:
    """The leader's answer to a peer whose hello checked out, with its own proof
    (``why``: the reason it may not join, None if it may)."""
    peer_nonce, nonce = hello.nonces
    mac = _mac(cfg, "leader", peer_nonce, nonce, str(hello.process), hello.fingerprint)
    _send_json(sock, {"ok": why is None, "error": why or "", "mac": mac})


def join_leader(sock: socket.socket, cfg: Distributed, fingerprint: str) -> None:
    """The follower's side of a hello on ``sock`` (connected to the leader): answer its
    challenge and check its answer (``LeaderGone`` if it refuses this process or does
    not prove it holds the secret)."""
    challenge = _recv_json(sock).get("nonce")
    if not isinstance(challenge, str):
        raise LeaderGone("distributed: the leader's port did not send a pxrt group hello")
    nonce = secrets.token_hex(16)
    pid = str(cfg.process_id)
    mac = _mac(cfg, "follower", challenge, nonce, pid, fingerprint)
    _send_json(
        sock, {"process_id": cfg.process_id, "fingerprint": fingerprint, "nonce": nonce, "mac": mac}
    )
    answer = _recv_json(sock)
    if not answer.get("ok"):
        raise LeaderGone(f"distributed: the leader refused this process: {answer.get('error')}")
    proof = answer.get("mac")
    want = _mac(cfg, "leader", nonce, challenge, pid, fingerprint)
    if not isinstance(proof, str) or not hmac.compare_digest(proof, want):
        raise LeaderGone(
            "distributed: the peer on the leader's port does not hold the group's secret"
        )


def fingerprint(manifest: dict, cells: Sequence[Any], devices: int) -> str:
    """What every process of a group must agree on: the artifact, the cells and the
    global device count."""
    doc = msgspec.json.encode({"manifest": manifest, "cells": cells, "devices": devices})
    return hashlib.sha256(doc).hexdigest()


# --------------------------------------------------------------------------- the leader


class _Step:
    __slots__ = ("seq", "done", "replies", "left")

    def __init__(self, seq: int, followers: int) -> None:
        self.seq = seq
        self.done = threading.Event()
        self.replies: list[Any] = [None] * followers
        self.left = followers


class _Peer:
    def __init__(self, process: int, sock: socket.socket) -> None:
        self.process = process
        self.sock = sock
        self.next_reply = 1
        self.reader: threading.Thread | None = None


class Group:
    """The leader's side of the lockstep: its followers' connections, the sequence
    numbers, the steps in flight and whether the group is broken."""

    def __init__(self, cfg: Distributed) -> None:
        self.cfg = cfg
        host, port = cfg.control_address
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.peers: list[_Peer] = []
        #: Held while a step's headers go out and its local execution starts.
        self.lock = threading.Lock()
        self._state = threading.Lock()
        self._seq = 0
        self._pending: dict[int, _Step] = {}
        #: Why the group is broken (None while it is whole).
        self.broken: str | None = None
        self._on_broken: list[Callable[[str], None]] = []
        self._closed = False
        #: Steps whose answers came back.
        self.steps = 0
        self._ignored_count = 0  # connections not let in, since the last log line
        self._ignored_next = 0.0

    def accept(self, fingerprint: str) -> None:
        """Wait for every follower to connect, prove it holds the group's secret and
        agree on ``fingerprint``. A connection that does not prove it is logged and
        ignored; a member that loaded another artifact (or says it is a process not
        awaited) breaks the group (``GroupBroken``)."""
        want = set(range(1, self.cfg.num_processes))
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        joined: queue.Queue = queue.Queue()
        done = threading.Event()
        listening = threading.Thread(
            target=self._listen, args=(joined, done), name="pxrt-group-accept", daemon=True
        )
        listening.start()
        try:
            while want:
                try:
                    sock, hello = joined.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    raise GroupBroken(
                        f"distributed: process(es) {sorted(want)} did not join the leader at "
                        f"{self.cfg.control_address[0]}:{self.cfg.control_address[1]} within "
                        f"{self.cfg.connect_timeout_s:g} s"
                    ) from None
                why = None
                if hello.process not in want:
                    why = f"process {hello.process!r} is not expected (waiting for {sorted(want)})"
                elif hello.fingerprint != fingerprint:
                    why = (
                        f"process {hello.process} loaded a different artifact, cells or device "
                        "count than the leader"
                    )
                try:
                    welcome(sock, self.cfg, hello, why)
                except OSError:
                    sock.close()
                    continue  # it went away: the group waits on
                if why is not None:
                    sock.close()
                    raise GroupBroken(f"distributed: {why}")
                sock.settimeout(None)
                _send_timeout(sock, self.cfg.step_timeout_s)
                want.discard(hello.process)
                self.peers.append(_Peer(hello.process, sock))
        finally:
            done.set()
            self._listener.close()
            listening.join(5)
            while not joined.empty():
                joined.get_nowait()[0].close()
        self.peers.sort(key=lambda p: p.process)
        for i, peer in enumerate(self.peers):
            peer.reader = threading.Thread(
                target=self._read, args=(i, peer), name=f"pxrt-group-{peer.process}", daemon=True
            )
            peer.reader.start()

    def _listen(self, joined: queue.Queue, done: threading.Event) -> None:
        """Accept connections until ``done``; each hello is heard on its own thread (at
        most ``MOST_HELLOS`` at once), so none holds up the others."""
        hearing = threading.BoundedSemaphore(MOST_HELLOS)
        self._listener.settimeout(0.2)
        while not done.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not hearing.acquire(blocking=False):
                sock.close()
                self._ignored(addr, "too many connections saying hello at once")
                continue
            threading.Thread(
                target=self._hear, args=(sock, addr, joined, hearing), daemon=True
            ).start()

    def _hear(self, sock: socket.socket, addr: Any, joined: queue.Queue, hearing: Any) -> None:
        try:
            sock.settimeout(HELLO_TIMEOUT_S)
            _nodelay(sock)
            joined.put((sock, greet_follower(sock, self.cfg)))
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            sock.close()
            self._ignored(addr, str(exc) or type(exc).__name__)
        finally:
            hearing.release()

    def _ignored(self, addr: Any, why: str) -> None:
        """Log a connection to the group's port that was not let in (one line per 10 s
        at most: a flood of them writes a few)."""
        now = time.monotonic()
        self._ignored_count += 1
        if now >= self._ignored_next:
            log.warning(
                "pxrt: distributed: ignored %d connection(s) to the group's port in the last "
                "10 s; the last from %s: %.200s",
                self._ignored_count,
                addr[0] if isinstance(addr, tuple) else addr,
                repr(why),
            )
            self._ignored_count = 0
            self._ignored_next = now + 10.0

    def on_broken(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (on whichever thread finds it) when the group breaks;
        at once if it is broken already."""
        self._on_broken.append(callback)
        if self.broken is not None:
            callback(self.broken)

    def check(self) -> None:
        """Raise ``GroupBroken`` if the group is broken."""
        if self.broken is not None:
            raise GroupBroken(self.broken)

    def send(self, cell: int, payloads: Sequence[Sequence[Any]]) -> _Step:
        """Send one step (the caller holds ``lock``): ``payloads[i]`` to follower ``i``."""
        with self._state:
            if self._closed:
                raise GroupBroken("the multi-host group was closed")
            if self.broken is not None:
                raise GroupBroken(self.broken)
            self._seq += 1
            step = _Step(self._seq, len(self.peers))
            self._pending[step.seq] = step
        for peer, payload in zip(self.peers, payloads):
            try:
                _send_framed(
                    peer.sock, functools.partial(HEADER.pack, _STEP, step.seq, cell), payload
                )
            except BlockingIOError as exc:  # SO_SNDTIMEO: it stopped reading
                self.fail(
                    f"process {peer.process} did not take batch {step.seq} within "
                    f"{self.cfg.step_timeout_s:g} s"
                )
                raise GroupBroken(self.broken) from exc
            except OSError as exc:
                self.fail(f"process {peer.process} went away ({exc})")
                raise GroupBroken(self.broken) from exc
            except BaseException as exc:  # its number is spent: the followers may differ
                self.fail(f"batch {step.seq} could not be sent: {exc!r}")
                raise
        return step

    def forget(self, step: _Step | None) -> None:
        """Drop a step whose answers nobody will wait for (a batch abandoned after a
        failure elsewhere)."""
        if step is not None:
            with self._state:
                self._pending.pop(step.seq, None)

    def launched(self, step: _Step, launch: Callable[[], Any]) -> Any:
        """``launch()``, the leader's own part of ``step`` (sent already): if it fails,
        the followers ran what the leader did not, so the group breaks."""
        try:
            return launch()
        except BaseException as exc:
            self.fail(f"the leader's own part of batch {step.seq} failed: {exc!r}")
            raise

    def wait(self, step: _Step) -> list[bytearray]:
        """The followers' answers to ``step`` (in follower order), or ``GroupBroken``."""
        if self.broken is None and not step.done.wait(self.cfg.step_timeout_s):
            late = [p.process for p, r in zip(self.peers, step.replies) if r is None]
            self.fail(
                f"process(es) {late} did not answer batch {step.seq} within "
                f"{self.cfg.step_timeout_s:g} s"
            )
        with self._state:
            self._pending.pop(step.seq, None)
        self.check()
        self.steps += 1
        return step.replies

    def _read(self, index: int, peer: _Peer) -> None:
        sock = peer.sock
        try:
            while True:
                magic, seq, status, n = REPLY.unpack(_recv_exact(sock, REPLY.size))
                if magic != _ANSWER or seq != peer.next_reply or n > _MOST_ANSWER:
                    self.fail(
                        f"process {peer.process} answered batch {seq} (magic {magic!r}, "
                        f"{n} bytes) when batch {peer.next_reply} was due: the group diverged"
                    )
                    return
                body = _recv_exact(sock, n)
                if status != _OK:
                    self.fail(
                        f"process {peer.process} failed batch {seq}: "
                        f"{body.decode('utf-8', 'replace')}"
                    )
                    return
                peer.next_reply += 1
                with self._state:
                    step = self._pending.get(seq)
                if step is None:
                    continue  # its waiter gave up already
                step.replies[index] = body
                with self._state:
                    step.left -= 1
                    finished = step.left == 0
                if finished:
                    step.done.set()
        except (OSError, ConnectionError) as exc:
            if not self._closed:
                self.fail(f"process {peer.process} went away ({exc})")
        except BaseException as exc:  # noqa: BLE001 - (a reader must not end unheard)
            self.fail(f"reading process {peer.process}'s answers failed: {exc!r}")

    def fail(self, reason: str) -> None:
        """Break the group: every step in flight and every later one fails."""
        with self._state:
            if self.broken is not None:
                return
            self.broken = (
                f"the multi-host group is broken: {reason}; restart every process of the group"
            )
            pending = list(self._pending.values())
        log.error("pxrt: %s", self.broken)
        for step in pending:
            step.done.set()
        for peer in self.peers:
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for callback in self._on_broken:
            try:
                callback(self.broken)
            except Exception:  # noqa: BLE001 - a reporter must not stop the others
                log.exception("pxrt: a group-broken callback failed")

    def close(self, timeout_s: float = 10.0, abort: bool = False) -> None:
        """Tell the followers to stop and wait (up to ``timeout_s``) until each has left
        jax's distributed runtime, whose service this process runs, and hung up; they
        return from ``follow``. ``abort``: hang up without telling them (a failed load:
        they stop with ``LeaderGone``)."""
        if self._closed:
            return
        with self.lock:
            with self._state:
                self._closed = True
                seq = self._seq + 1
            for peer in self.peers:
                if self.broken is None and not abort:
                    try:
                        _send(peer.sock, [HEADER.pack(_STEP, seq, STOP, 0)])
                    except OSError:
                        pass
            deadline = time.monotonic() + timeout_s
            for peer in self.peers:
                if peer.reader is not None and self.broken is None and not abort:
                    peer.reader.join(max(0.0, deadline - time.monotonic()))
                try:
                    peer.sock.shutdown(socket.SHUT_RDWR)  # (wakes its reader)
                except OSError:
                    pass
                peer.sock.close()
            try:
                self._listener.close()
            except OSError:
                pass


class LockstepProgram:
    """The leader's program for one cell (``pxrt.dispatch.Program``): whole staging
    buffers in; each follower's rows out to it, the leader's rows onto its devices, the
    same executable everywhere; the outputs back together as per-device shards."""

    def __init__(self, group: Group, cell: int, part: LocalPart, layout: Layout) -> None:
        import jax

        self.group = group
        self.cell = cell
        self.part = part
        self.path = f"lockstep, {part.path}"  # (pxrt inspect; its own part's path)
        self.layout = layout
        self.row_slices = [slice(0, layout.size)]
        self.out_shard_rows = layout.per_device
        self._peer_rows = [layout.rows[p.process] for p in group.peers]
        self._mine = layout.rows[0]
        outs = jax.tree.leaves(part.compiled.out_info)
        self._out_specs = [(np.dtype(o.dtype), tuple(o.shape[1:])) for o in outs]
        self._gather = RowGather(group, layout)

    def dispatch(self, slot: Any) -> Any:
        buffers = slot.buffers
        payloads = [[b[r] for b in buffers] for r in self._peer_rows]
        group = self.group
        with group.lock:
            step = group.send(self.cell, payloads)
            outs = group.launched(step, lambda: self.part.launch([b[self._mine] for b in buffers]))
        return step, outs

    def fetch(self, handle: Any) -> list[list[np.ndarray]]:
        step, outs = handle
        # The followers' answers first: with a follower gone, the leader's own outputs
        # may never come (a collective in the model) or be wrong (gloo).
        replies = self.group.wait(step)
        return self._gather.shards(self.part.rows(outs), replies, self._out_specs)


class RowGather:
    """Row-sharded outputs on the leader, whole: its own shards and each follower's
    answer (that follower's rows of every output), in row order."""

    def __init__(self, group: Group, layout: Layout) -> None:
        self.group = group
        self.per_device = layout.per_device
        self._peer_rows = [layout.rows[p.process] for p in group.peers]
        self._order = sorted(
            [(layout.rows[0].start, -1)] + [(r.start, i) for i, r in enumerate(self._peer_rows)]
        )

    def shards(
        self,
        mine: list[list[np.ndarray]],
        replies: Sequence[bytearray],
        specs: Sequence[tuple[np.dtype, tuple[int, ...]]],
    ) -> list[list[np.ndarray]]:
        """Per output, every device's rows in row order: ``mine`` (the leader's shards
        per output) and each answer (``specs``: each output's dtype and row shape) cut
        per device."""
        per_output: list[list[np.ndarray]] = [[] for _ in mine]
        step = self.per_device
        for _, who in self._order:
            if who < 0:
                for out, shards in zip(per_output, mine):
                    out.extend(shards)
                continue
            r = self._peer_rows[who]
            try:
                rows = split_rows(replies[who], specs, r.stop - r.start)
            except ValueError as exc:
                self.group.fail(f"process {self.group.peers[who].process}'s answer has {exc}")
                raise GroupBroken(self.group.broken) from exc
            for out, a in zip(per_output, rows):
                out.extend(a[i : i + step] for i in range(0, len(a), step))
        return per_output

    def __call__(self, array: Any, replies: Sequence[bytearray]) -> np.ndarray:
        """One output (``array``, the leader's), whole."""
        mine = local_rows(array)
        spec = [(mine[0].dtype, mine[0].shape[1:])]
        return np.concatenate(self.shards([mine], replies, spec)[0])


# --------------------------------------------------------------------------- followers


def split_rows(
    body: bytearray, specs: Sequence[tuple[np.dtype, tuple[int, ...]]], rows: int
) -> list[np.ndarray]:
    """``rows`` rows of each array of ``specs`` (dtype, row shape), one after the other
    in ``body`` (views, no copy)."""
    out, offset = [], 0
    for dtype, shape in specs:
        count = rows * math.prod(shape)
        out.append(np.frombuffer(body, dtype, count, offset).reshape((rows,) + shape))
        offset += count * dtype.itemsize
    if offset != len(body):
        raise ValueError(f"{len(body)} bytes where {offset} were due")
    return out


class FollowerCell:
    """A follower's part of one cell of a model: its rows in, its output rows out."""

    def __init__(
        self,
        part: LocalPart,
        layout: Layout,
        in_specs: Sequence[tuple[np.dtype, tuple[int, ...]]],  # per input: dtype, row shape
    ) -> None:
        self.part = part
        self.in_specs = tuple(in_specs)
        mine = layout.rows[layout.process]
        self._rows = mine.stop - mine.start
        self.payload_bytes = sum(self._rows * math.prod(s) * d.itemsize for d, s in self.in_specs)

    def run(self, body: bytearray) -> list[Any]:
        buffers = split_rows(body, self.in_specs, self._rows)
        part = self.part
        return [shard for shards in part.rows(part.launch(buffers)) for shard in shards]


class Follower:
    """A follower process of a multi-host group, loaded: ``follow()`` connects to the
    leader and runs its batches until the leader stops the group (it returns, having
    left jax's distributed runtime) or goes away (``LeaderGone``: leave the process
    with ``os._exit``, as jax's exit hook would wait for the gone leader). ``stop()``
    (on SIGTERM) ends it sooner. ``state``: "loaded", "connecting", "following",
    "stopped", "left" (``stop``'s grace ran out) or "leader gone"."""

    def __init__(
        self, cfg: Distributed, name: str, programs: list[Any], fingerprint: str, load_s: float
    ) -> None:
        self.cfg = cfg
        self.name = name
        #: What the leader's headers index: each has ``payload_bytes`` (what its step
        #: sends) and ``run(body)`` (runs it; returns the buffers to answer with).
        self.programs = programs
        self.fingerprint = fingerprint
        self.load_s = load_s
        self.state = "loaded"
        #: Batches run so far.
        self.steps = 0
        self._sock: socket.socket | None = None
        self._stopping: threading.Timer | None = None
        self._left = False

    def __repr__(self) -> str:
        return (
            f"Follower({self.name!r}, process {self.cfg.process_id} of "
            f"{self.cfg.num_processes}, {len(self.programs)} programs, {self.state})"
        )

    def _connect(self) -> socket.socket:
        host, port = self.cfg.control_address
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise LeaderGone(
                        f"distributed: process {self.cfg.process_id} could not reach the leader "
                        f"at {host}:{port} within {self.cfg.connect_timeout_s:g} s ({exc})"
                    ) from exc
                time.sleep(0.05)
        _nodelay(sock)
        try:
            # The leader says hello once it has compiled too.
            sock.settimeout(self.cfg.connect_timeout_s)
            join_leader(sock, self.cfg, self.fingerprint)
            sock.settimeout(None)
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            sock.close()
            raise LeaderGone(
                f"distributed: process {self.cfg.process_id} could not join the leader at "
                f"{host}:{port} ({exc})"
            ) from exc
        except LeaderGone:
            sock.close()
            raise
        return sock

    def follow(self) -> None:
        """Run the leader's batches, in its order, until it stops the group (or
        ``stop``'s grace runs out: state "left")."""
        self.state = "connecting"
        try:
            sock = self._connect()
        except LeaderGone:
            self.state = "leader gone"
            raise
        self._sock = sock
        self.state = "following"
        last = 0
        try:
            if self._left:  # stop()'s grace ran out while it connected
                self.state = "left"
                return
            while True:
                try:
                    last = self._step(sock, last)
                except (OSError, ConnectionError) as exc:
                    if self._left:  # stop()'s grace ran out: this process hung up
                        self.state = "left"
                        return
                    raise LeaderGone(
                        f"distributed: the leader went away after batch {last} ({exc}): it "
                        f"stopped, or broke the group; process {self.cfg.process_id} stops"
                    ) from exc
                if self.state == "stopped":
                    _leave_group()
                    return
        except LeaderGone:
            self.state = "leader gone"
            raise
        finally:
            if self._stopping is not None:
                self._stopping.cancel()
            sock.close()

    def stop(self, grace_s: float) -> None:
        """This process was asked to stop (``pxrt serve``'s follower calls this on
        SIGTERM; safe from a signal handler): ``follow`` goes on until the leader stops
        the group, as it does when the whole group is stopped (the leader drains, and
        every batch it still runs needs every follower), but for at most ``grace_s``.
        Then it hangs up and returns (state "left"): the group is broken, its leader
        turns not ready, and this process, still in jax's distributed runtime whose
        service the leader runs, should leave with ``os._exit``. Called again: nothing
        changes."""
        if self._stopping is not None:
            return
        self._stopping = threading.Timer(grace_s, self._hang_up)
        self._stopping.daemon = True
        self._stopping.start()

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` was called."""
        return self._stopping is not None

    def _hang_up(self) -> None:
        self._left = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes follow()'s read
            except OSError:
                pass

    def _step(self, sock: socket.socket, last: int) -> int:
        """Receive, run and answer one batch (the leader's ``STOP``: state "stopped");
        returns its sequence number."""
        magic, seq, cell, n = HEADER.unpack(_recv_exact(sock, HEADER.size))
        if magic != _STEP or seq != last + 1:
            raise LeaderGone(
                f"distributed: the leader sent batch {seq} (magic {magic!r}) when "
                f"batch {last + 1} was due: the group diverged"
            )
        if cell == STOP:
            self.state = "stopped"
            return seq
        if cell >= len(self.programs) or n != self.programs[cell].payload_bytes:
            raise LeaderGone(
                f"distributed: batch {seq} names program {cell} with {n} bytes; "
                f"this process has {len(self.programs)} programs"
            )
        body = _recv_exact(sock, n)
        parts: list[Any]
        try:
            parts = self.programs[cell].run(body)
            status = _OK
        except Exception as exc:  # noqa: BLE001 - reported to the leader
            parts, status = [repr(exc).encode()], _FAILED
        _send_framed(sock, functools.partial(REPLY.pack, _ANSWER, seq, status), parts)
        self.steps += 1
        return seq


def _leave_group() -> None:
    """Leave jax's distributed runtime while the leader, which runs its service, waits
    for it (at exit it would be too late: the leader may be gone)."""
    import jax

    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - leaving anyway
        log.exception("pxrt: leaving jax's distributed runtime failed")


# --------------------------------------------------------------------------- load


def load(
    path: Any,
    cfg: Distributed,
    *,
    buckets: Any = None,
    dim_buckets: Any = None,
    progress: bool | None = None,
    compilation_cache: Any = True,
    staging_depth: int = 3,
    max_routes: int = 256,
    compile_workers: int | None = None,
) -> Any:
    """``pxrt.load(path, distributed=cfg)``: the leader's ``Model`` or a ``Follower``."""
    import concurrent.futures
    import os

    from . import _xla, artifact, compiling, executable
    from .dispatch import Bucket, StagingRing

    t0 = time.perf_counter()
    initialize(cfg)
    import jax

    group = Group(cfg) if cfg.leader else None  # listening before the compiles: followers
    try:  # that finish first wait in its backlog
        art = artifact.read(path)
        devices = jax.devices()
        cache_dir = compiling.cache_dir(compilation_cache)
        _xla.compile_counter.ensure_registered()
        settings = compiling.Settings(
            art, cache_dir, False, False, staging_depth, compile_workers, progress
        )
        cells = compiling.grid(art, buckets, dim_buckets, len(devices))
        phases = {"read": time.perf_counter() - t0}
        with _xla.x64_scope(art.x64), _xla.persistent_cache(cache_dir):
            tp = time.perf_counter()
            inst = compiling.Instance(settings, devices)
            phases["params"] = time.perf_counter() - tp
            tp = time.perf_counter()
            bar = compiling.progress_bar(
                len(cells),
                f"pxrt: compiling {art.name} (process {cfg.process_id})",
                "bucket",
                progress,
            )

            def compile_one(cell: tuple[int, tuple[int, ...]]) -> tuple[Any, str, float]:
                tc = time.perf_counter()
                compiled, source = inst.compile_cell(*cell)
                bar.update()
                return compiled, source, time.perf_counter() - tc

            workers = max(1, min(compile_workers or os.cpu_count() or 1, len(cells)))
            with bar, concurrent.futures.ThreadPoolExecutor(workers) as pool:
                compiled = list(pool.map(compile_one, cells))
            phases["compile"] = time.perf_counter() - tp
            process = jax.process_index()
            layouts = [Layout.of(inst.rows, size, process) for size, _ in cells]
            fp = fingerprint(art.manifest, cells, len(devices))
            # Each process's part of each cell, its path checked on its rows of an
            # example (every process in the same order: a model's collectives pair up).
            tp = time.perf_counter()
            dims = tuple(art.dim_buckets)
            examples = [
                compiling.staged_example(art.inputs, size, dict(zip(dims, lengths)))
                for size, lengths in cells
            ]
            parts = [
                LocalPart(
                    c[0],
                    inst.params_dev,
                    layout,
                    inst.rows,
                    art.x64,
                    [x[layout.rows[process]] for x in example],
                )
                for c, layout, example in zip(compiled, layouts, examples)
            ]
            phases["check"] = time.perf_counter() - tp
            if group is None:
                follower_cells = [
                    FollowerCell(
                        part,
                        layout,
                        tuple(
                            (np.dtype(s.dtype), s.at(dict(zip(dims, lengths))))
                            for s in art.inputs.values()
                        ),
                    )
                    for part, layout, (_, lengths) in zip(parts, layouts, cells)
                ]
                return Follower(cfg, art.name, follower_cells, fp, time.perf_counter() - t0)
            tp = time.perf_counter()
            group.accept(fp)
            phases["connect"] = time.perf_counter() - tp
            tp = time.perf_counter()
            built = []
            in_specs = list(art.inputs.values())
            for i, ((size, lengths), (exe, source, obtain_s), layout, part, example) in enumerate(
                zip(cells, compiled, layouts, parts, examples)
            ):
                program = LockstepProgram(group, i, part, layout)
                at = dict(zip(art.dim_buckets, lengths))
                slot = _xla.StagingSlot(example, program.row_slices)
                _xla.run_program(program, slot)  # warm-up, on every process
                exec_s = _xla.time_program(program, slot)
                ring = StagingRing(
                    [s.dtype for s in in_specs],
                    [s.at(at) for s in in_specs],
                    size,
                    program.row_slices,
                    depth=staging_depth,
                )
                built.append(Bucket(size, program, ring, exe, obtain_s, exec_s, lengths, source))
            phases["time"] = time.perf_counter() - tp
    except BaseException:
        if group is not None:
            group.close(abort=True)
        raise
    model = executable.Model(
        art, devices, built, inst.params_dev, time.perf_counter() - t0, max_routes
    )
    model.group = group
    model.load_phases = {k: round(v, 4) for k, v in phases.items()}
    model.placement_reason = (
        f"multi-host: one program over {len(devices)} device(s) of {cfg.num_processes} "
        "processes, batches in lockstep"
    )
    log.info("pxrt: %s version %s %s", art.name, model.version, model.load_summary())
    return model
