"""What front-end workers and the device process say to each other (``pxrt serve
--workers N``): the messages, their framing, and the shared memory tensors cross by.

Each worker holds one Unix stream socket to the device process. A frame is a 4-byte
length and a msgpack message (``msgspec``: typed, ~1 us to encode or decode one);
everything one side writes in one turn of its event loop goes out in one
``writelines``. A tensor travels inline, as the message's bytes (decoded on the other
side as a view of them: no copy beyond the socket's), unless it is at least
``SHARED_MIN`` bytes: then its bytes are in shared memory and the message says where.
Each side owns one ``Arena`` per worker (the worker's for requests, the device's for
answers): the owner allocates, the other side reads, and the owner frees once the
other side is done with the bytes (``Result`` frees a request's, ``Free`` an answer's).
Nothing is pickled.

Worker -> device: ``Hello`` (once), ``Infer``, ``Cancel`` (the client hung up),
``Count`` (a request the front end answered itself), ``Call`` (any other HTTP request,
or gRPC method, answered by the device process's own front end: one view of models,
statistics, metrics and the repository for all workers), ``Free``, ``Generate`` (a
generation for a decoder), ``Stop`` (end one: the client hung up, a stop string, a
deadline).
Device -> worker: ``State`` (readiness, draining and the models and decoders served,
whenever they change), ``Result``, ``Reply``, ``Tokens`` (a generation's acceptance or
refusal, then its tokens as they come, then its end).
"""

from __future__ import annotations

import secrets
import struct
from bisect import bisect_left, insort
from multiprocessing import shared_memory
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy: np.dtype("bfloat16")
import msgspec
import numpy as np

from pxrt.decoder.params import SamplingParams

from ..kserve.shm import OWN_PREFIX

SHARED_MIN = 64 << 10  # tensors at least this large cross through shared memory
_LENGTH = struct.Struct("<I")


class Tensor(msgspec.Struct, array_like=True):
    """An array: inline (``data``), or ``nbytes`` at ``offset`` of the sender's arena."""

    name: str
    dtype: str
    shape: list[int]
    data: memoryview | None = None
    offset: int = -1
    nbytes: int = 0


class Spec(msgspec.Struct, array_like=True):
    """A model input's or output's name, dtype, per-example shape and pad value."""

    name: str
    dtype: str
    shape: list[int | str]
    pad: float | int | bool = 0


class Version(msgspec.Struct, array_like=True):
    """What a front end needs to decode requests for a version of a model."""

    version: str
    inputs: list[Spec]
    outputs: list[Spec]
    buckets: list[int]
    dim_buckets: dict[str, list[int]]
    embedding: bool = False  # an embedding model (``/v1/embeddings`` serves it)


class Served(msgspec.Struct, array_like=True):
    name: str
    newest: str
    versions: list[Version]


class Error(msgspec.Struct, array_like=True):
    """An exception, by its kind in the request core's error table
    (``serving.kserve.core.error_kind``)."""

    kind: str
    message: str
    retry_after_s: float = 0.0


# ----------------------------------------------------------------- worker -> device


class Hello(msgspec.Struct, tag=1, array_like=True):
    pid: int
    arena: str  # the worker's shared memory for request tensors


class Infer(msgspec.Struct, tag=2, array_like=True):
    rid: int
    model: str
    version: str | None
    timeout_s: float | None
    inputs: list[Tensor]
    priority: int = 0


class Cancel(msgspec.Struct, tag=3, array_like=True):
    rid: int


class Count(msgspec.Struct, tag=4, array_like=True):
    model: str
    version: str
    outcome: str


class Call(msgspec.Struct, tag=5, array_like=True):
    """``kind`` "http": ``method``, ``target`` (path and query), ``headers``, ``body``;
    "grpc": ``method`` (its name), ``headers`` (the call's metadata), ``body`` (the
    request message), ``timeout_s``."""

    cid: int
    kind: str
    method: str
    target: str
    headers: list[tuple[bytes, bytes]]
    body: memoryview
    timeout_s: float | None = None


class Free(msgspec.Struct, tag=6, array_like=True):
    offsets: list[int]


class Generate(msgspec.Struct, tag=7, array_like=True):
    gid: int
    model: str
    ids: list[int]
    params: SamplingParams  # checked by the worker's front end, and again when decoded


class Stop(msgspec.Struct, tag=8, array_like=True):
    gid: int
    reason: str  # the finish reason it ends with


# ----------------------------------------------------------------- device -> worker


class DecoderInfo(msgspec.Struct, array_like=True):
    """A decoder served, as a worker's front ends need it: to tokenize and render."""

    name: str
    version: str
    path: str  # its artifact directory (a tokenizer file is read from there)
    tokenizer: dict[str, Any] | None
    chat_template: str | None


class State(msgspec.Struct, tag=11, array_like=True):
    not_serving: str | None  # why inference requests are refused now (loading, draining)
    draining: bool
    models: list[Served]
    arena: str  # the device's shared memory for this worker's answers
    decoders: list[DecoderInfo] = []


class Result(msgspec.Struct, tag=12, array_like=True):
    rid: int
    outputs: list[Tensor] | None = None
    error: Error | None = None


class Reply(msgspec.Struct, tag=13, array_like=True):
    """An HTTP answer (``status``, ``headers``, ``body``) or a gRPC one (``status``:
    its code, ``message``, ``body``: the response message)."""

    cid: int
    status: int
    headers: list[tuple[bytes, bytes]]
    body: memoryview
    message: str = ""


class Tokens(msgspec.Struct, tag=14, array_like=True):
    """A generation's news: none yet and no end (accepted), ``error`` without an end
    (refused), tokens, or its end (``finish_reason``, with ``error`` if it failed)."""

    gid: int
    tokens: list[int]
    finish_reason: str | None = None
    error: Error | None = None
    # With logprobs: per token, [its log-probability, [[id, log-probability], ...]].
    logprobs: list | None = None
    # With prompt_logprobs, with the first token: the same per prompt token (null first).
    prompt_logprobs: list | None = None


ToDevice = Hello | Infer | Cancel | Count | Call | Free | Generate | Stop
ToWorker = State | Result | Reply | Tokens

_encoder = msgspec.msgpack.Encoder()


def frame(message: msgspec.Struct) -> bytes:
    """A message as it goes on the socket: its length, then its msgpack bytes."""
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


class FrameWriter:
    """Sending frames on a link (a mixin of either end's protocol, which sets
    ``transport``, ``loop`` and ``closed``): what is sent in one turn of the event loop
    goes out in one ``writelines``."""

    transport: Any
    loop: Any
    closed: bool
    _out: list[bytes]
    _flushing: bool

    def send(self, message: msgspec.Struct) -> None:
        if self.closed:
            return
        self._out.append(frame(message))
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        out, self._out = self._out, []
        if out and not self.closed:
            self.transport.writelines(out)


class Reader:
    """Messages out of a stream of frames (``feed`` each chunk received). Decoded
    messages view the chunk's bytes: a tensor inline in one costs no copy."""

    def __init__(self, kind: Any) -> None:
        self.decoder = msgspec.msgpack.Decoder(kind)
        self.pending = b""

    def feed(self, data: bytes) -> list[Any]:
        if self.pending:
            data = self.pending + data
            self.pending = b""
        view = memoryview(data)
        out = []
        pos, end = 0, len(data)
        unpack, decode = _LENGTH.unpack_from, self.decoder.decode
        while end - pos >= 4:
            (n,) = unpack(data, pos)
            if end - pos - 4 < n:
                break
            out.append(decode(view[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        if pos < end:
            self.pending = bytes(view[pos:])
        return out


# ----------------------------------------------------------------- shared memory


_OWNED: set[str] = set()  # the arenas this process made


def _create(size: int) -> shared_memory.SharedMemory:
    """A new segment named as every pxrt process names its own (``shm.OWN_PREFIX``), so
    that no pxrt server lets a client register it (--allow-client-shm)."""
    while True:
        try:
            return shared_memory.SharedMemory(
                name=OWN_PREFIX + secrets.token_hex(8), create=True, size=size
            )
        except FileExistsError:  # (as multiprocessing's own names: another one)
            continue


class Arena:
    """One side's shared memory for the tensors it sends: first-fit allocation over a
    sorted free list (coalesced as it is freed). ``attach`` opens the other side's."""

    ALIGN = 64

    def __init__(self, size: int, name: str | None = None) -> None:
        if name is None:
            self.shm = _create(size)
        else:
            self.shm = shared_memory.SharedMemory(name=name, size=size)
        self.size = self.shm.size
        self.owner = name is None
        if self.owner:
            _OWNED.add(self.shm.name)
        self.closed = False
        self.free_list: list[tuple[int, int]] = [(0, self.size)] if self.owner else []
        self.used: dict[int, int] = {}  # offset -> size

    @classmethod
    def attach(cls, name: str) -> Arena:
        arena = cls(0, name)
        # Python < 3.13 registers an attached segment with this process's resource
        # tracker, which unlinks it when this process exits: the owner does that.
        if name not in _OWNED:  # (both ends in one process: tests)
            from multiprocessing import resource_tracker

            try:
                resource_tracker.unregister(arena.shm._name, "shared_memory")  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - (3.13+: nothing was registered)
                pass
        return arena

    @property
    def name(self) -> str:
        return self.shm.name

    def alloc(self, nbytes: int) -> int:
        """The offset of ``nbytes`` of free space, or -1 when none is left."""
        need = -(-nbytes // self.ALIGN) * self.ALIGN
        for i, (offset, size) in enumerate(self.free_list):
            if size >= need:
                if size == need:
                    del self.free_list[i]
                else:
                    self.free_list[i] = (offset + need, size - need)
                self.used[offset] = need
                return offset
        return -1

    def free(self, offset: int) -> None:
        size = self.used.pop(offset, 0)
        if not size:
            return
        free = self.free_list
        i = bisect_left(free, (offset, 0))
        if i < len(free) and offset + size == free[i][0]:  # joins the next
            size += free[i][1]
            del free[i]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # joins the previous
            offset, size = free[i - 1][0], free[i - 1][1] + size
            del free[i - 1]
        insort(free, (offset, size))

    def put(self, arr: np.ndarray) -> int:
        """Copy ``arr`` into the arena; its offset, or -1 when it does not fit."""
        offset = self.alloc(arr.nbytes)
        if offset >= 0:
            target = np.ndarray(arr.shape, arr.dtype, self.shm.buf, offset)
            np.copyto(target, arr, casting="no")
        return offset

    def view(self, tensor: Tensor, dtype: np.dtype) -> np.ndarray:
        """The array ``tensor`` names in this arena (a view of the shared memory)."""
        return np.ndarray(tuple(tensor.shape), dtype, self.shm.buf, tensor.offset)

    def close(self) -> None:
        """Unmap it (and, the owner, remove it); closing twice does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
        try:
            self.shm.close()
        except BufferError:  # (a view outlives it: the mapping goes with the process)
            pass


_NAMES: dict[np.dtype, str] = {}  # dtype -> its name (numpy computes it in Python)
_DTYPES: dict[str, np.dtype] = {}


def to_tensor(name: str, arr: np.ndarray, arena: Arena | None) -> Tensor:
    """``arr`` as it crosses: through ``arena`` when large and there is room."""
    dtype = arr.dtype
    dtype_name = _NAMES.get(dtype)
    if dtype_name is None:
        dtype_name = _NAMES[dtype] = dtype.name
    if arena is not None and arr.nbytes >= SHARED_MIN:
        offset = arena.put(arr)
        if offset >= 0:
            return Tensor(name, dtype_name, list(arr.shape), None, offset, arr.nbytes)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    # (a uint8 view: custom dtypes such as bfloat16 have no buffer format of their own)
    return Tensor(name, dtype_name, list(arr.shape), arr.reshape(-1).view(np.uint8).data)


def from_tensor(tensor: Tensor, arena: Arena | None) -> np.ndarray:
    """The array a ``Tensor`` carries: a view of the message, or of the sender's arena."""
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        dtype = _DTYPES[tensor.dtype] = np.dtype(tensor.dtype)
    if tensor.data is not None:
        return np.frombuffer(tensor.data, dtype).reshape(tensor.shape)
    assert arena is not None
    return arena.view(tensor, dtype)


__all__ = [
    "SHARED_MIN",
    "Arena",
    "Call",
    "Cancel",
    "Count",
    "DecoderInfo",
    "Error",
    "FrameWriter",
    "Free",
    "Generate",
    "Hello",
    "Infer",
    "Reader",
    "Reply",
    "Result",
    "Served",
    "Spec",
    "State",
    "Stop",
    "Tensor",
    "Tokens",
    "ToDevice",
    "ToWorker",
    "Version",
    "frame",
    "from_tensor",
    "to_tensor",
]
