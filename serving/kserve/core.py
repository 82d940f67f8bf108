"""The request core: one KServe v2 inference path for every front end.

A front end translates its transport and nothing else. It hands ``infer`` the model's
name and version, a ``decode`` that makes an ``InferRequest`` for the model resolved
(``InferRequest.from_json`` over HTTP, ``from_proto`` over gRPC) and an ``encode`` that
makes its reply; ``infer`` does the rest, the same for all: readiness, the lookup, the
queue, the outcome counts. Every error a front end answers maps through one table,
``status_of``, to its HTTP status and its gRPC code, with the same message on both.
(KServe's own ``dataplane.py`` is the pattern.)

Outcomes: a request that does not follow the protocol counts ``invalid`` (its model's
queue counts the ones that fail validation), an unexpected error anywhere on its path
counts ``failed`` and is logged once, in one line; the rest are counted by the queue and
the batcher (success, rejected, expired, cancelled).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..access import Forbidden, KeyRepeated
from ..errors import (
    DeadlineExceeded,
    ExecutionFailed,
    NoRepository,
    Overloaded,
    RepositoryError,
    ServerClosed,
    ServingError,
    UnknownModel,
)
from ..logs import printable
from . import codec
from .codec import ProtocolError
from .shm import UnknownRegion, check_read, faults

if TYPE_CHECKING:
    from ..tracing import Trace
    from .backend import Backend, ServedDecoder, ServedModel
    from .shm import Regions


log = logging.getLogger("pxrt.core")

T = TypeVar("T")


class NotServing(ServingError):
    """The server is loading or draining: it takes no inference requests now."""


class InvalidRequest(ServingError, ValueError):
    """A request the model refuses: a missing or unexpected input, a wrong dtype or
    shape, more rows than its queue holds... (the validation's own message)."""


class TooLarge(ProtocolError):
    """A request, or a part of it, over a size limit (HTTP 413)."""


class InternalError(ServingError):
    """An unexpected error on a request's path (a bug): answered 500 / INTERNAL."""


class BodiesFull(ServingError):
    """The server holds its budget of request bodies: retry later (503 / UNAVAILABLE)."""


class BodyBudget:
    """Bytes of request bodies held at once, over all requests of every front end that
    shares it (``pxrt serve``: HTTP and gRPC): a request that would go over it is
    answered ``BodiesFull`` instead of growing memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n

    def full(self) -> BodiesFull:
        """The error a request over the budget is answered with."""
        return BodiesFull(
            f"the server holds the most request bodies it may ({self.limit} bytes); retry later"
        )


class Upload:
    """One request body as it arrives, within ``limit`` bytes and the server's
    ``budget`` of bytes held over all requests (every HTTP path): ``TooLarge`` (413) or
    ``BodiesFull`` (503) as soon as it goes over (``length``: what the request says it
    has, checked before anything is read; ``what``: the body, in messages).
    ``release`` gives back what it holds (once the reply is made: inputs may view the
    body until then)."""

    __slots__ = ("budget", "chunks", "held", "limit", "what")

    def __init__(
        self,
        budget: BodyBudget,
        limit: int,
        length: str | bytes | None,
        what: str = "the request body",
    ) -> None:
        self.limit = limit
        self.budget = budget
        self.what = what
        self.chunks: list[bytes] = []
        self.held = 0
        if length is not None and length.isdigit() and int(length) > limit:
            n = length.decode() if isinstance(length, bytes) else length
            raise TooLarge(f"{what} has {n} bytes; the limit is {limit}")

    def add(self, chunk: bytes) -> None:
        if self.held + len(chunk) > self.limit:
            raise TooLarge(f"{self.what} is over the limit of {self.limit} bytes")
        if not self.budget.take(len(chunk)):
            raise self.budget.full()
        self.held += len(chunk)
        self.chunks.append(chunk)

    def body(self) -> bytes:
        chunks = self.chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self, chunks: AsyncIterator[bytes]) -> bytes:
        """Take every chunk of a body as it comes (an ASGI request's ``stream()``)."""
        async for chunk in chunks:
            self.add(chunk)
        return self.body()

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0
        self.chunks = []


# --------------------------------------------------------------------------- requests


@dataclasses.dataclass(slots=True)
class InferRequest:
    """One inference request, decoded for its model.

    Attributes:
      inputs: input name -> array with a leading batch dimension (views of the
        transport's bytes where the data came raw).
      outputs: (output name, as binary data) to answer with, in order.
      id: the request's id, echoed in the answer.
      timeout_s: its deadline in seconds from now (None: the model's default).
      priority: its priority level (1 the highest; 0: the model's default).
    """

    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, Any]]  # (name, as binary or ``shm.Placed``)
    id: str | None = None
    timeout_s: float | None = None
    priority: int = 0

    @classmethod
    def from_json(
        cls,
        header: memoryview | bytes,
        binary: memoryview,
        model: ServedModel,
        regions: Regions | None = None,
    ) -> InferRequest:
        """A KServe v2 JSON request (``header``) with its binary tensor data.

        A header whose tensors all come as binary data is remembered per model with what
        it decoded to (``codec.BinaryPlan``): the same header again (load generators and
        most clients send the same one for every request of a shape) is decoded by one
        dict lookup and a view per input, not a JSON parse and its checks. ``regions``:
        the system shared memory the request may name (``serving.kserve.shm``)."""
        plans = _plans(model)
        try:
            plan = plans.get(header)
        except (TypeError, ValueError):  # a writable buffer cannot be a key
            plan = None
        if plan is not None and plan.size == len(binary):
            return cls(plan.views(binary), plan.outputs, plan.id, plan.timeout_s, plan.priority)
        doc = codec.parse_json(header)
        rid = codec.request_id(doc)
        request = cls(
            inputs=codec.decode_inputs(doc, binary, model.inputs, regions),
            outputs=codec.requested_outputs(doc, list(model.outputs), regions),
            id=rid,
            timeout_s=codec.timeout_of(doc),
            priority=codec.priority_of(doc),
        )
        if len(header) <= PLAN_HEADER_BYTES:
            plan = codec.BinaryPlan.of(
                doc, request.inputs, request.outputs, rid, request.timeout_s, request.priority
            )
            if plan is not None:
                if len(plans) >= PLANS_PER_MODEL:
                    plans.clear()  # many different headers (ids, shapes): start over
                plans[bytes(header)] = plan  # a copy: the key outlives the body
        return request

    @classmethod
    def from_proto_bytes(
        cls,
        data: Any,
        model: ServedModel,
        parse: Callable[[Any], Any],
        deadline_s: float | None = None,
        regions: Regions | None = None,
    ) -> InferRequest:
        """A serialized ModelInferRequest (``parse`` makes the message of its bytes, or
        raises ``ProtocolError``), as ``from_proto``.

        A message whose inputs all come as raw contents is remembered per model by its
        layout (``codec.ProtoPlan``): a message laid out the same (clients send the same
        description for every request of a shape, only the tensors' bytes differ) is
        decoded by a comparison of its description and a view per input of its bytes,
        not a parse and its checks."""
        plans = _proto_plans(model)
        candidates = plans.get(len(data))
        if candidates is not None:
            for plan in candidates:
                if plan.matches(data):
                    timeout = plan.timeout_s if plan.timeout_s is not None else deadline_s
                    return cls(plan.views(data), plan.outputs, plan.id, timeout, plan.priority)
        message = parse(data)
        request = cls.from_proto(message, model, deadline_s, regions)
        if message.raw_input_contents and codec.inline(request.outputs):
            plan = codec.ProtoPlan.of(
                data, request.inputs, request.outputs, message.id,
                codec.proto_timeout(message), request.priority,
            )  # fmt: skip
            if plan is not None and len(plan.prefix) <= PLAN_HEADER_BYTES:
                if len(plans) >= PLANS_PER_MODEL:
                    plans.clear()  # many different sizes: start over
                same_size = plans.setdefault(len(data), [])
                if len(same_size) >= PLANS_PER_SIZE:
                    del same_size[0]  # (ids of one length that differ: the oldest goes)
                same_size.append(plan)
        return request

    @classmethod
    def from_proto(
        cls,
        message: Any,
        model: ServedModel,
        deadline_s: float | None = None,
        regions: Regions | None = None,
    ) -> InferRequest:
        """A ModelInferRequest; its ``timeout`` parameter, else ``deadline_s`` (the
        call's own deadline), is its deadline."""
        inputs = codec.decode_proto_inputs(message, model.inputs, regions)
        outputs = codec.requested_proto_outputs(message, list(model.outputs), regions)
        timeout_s = codec.proto_timeout(message)
        return cls(
            inputs=inputs,
            outputs=outputs,
            id=message.id,
            timeout_s=timeout_s if timeout_s is not None else deadline_s,
            priority=codec.proto_priority(message),
        )


PLANS_PER_MODEL = 64  # request headers (sizes: gRPC) remembered per model
PLANS_PER_SIZE = 8  # gRPC: layouts of one message size remembered per model
PLAN_HEADER_BYTES = 4096  # longer headers are not remembered (the table stays small)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its plans
_PROTO_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> size -> plans


def _plans(model: ServedModel) -> dict:
    """``model``'s header -> ``codec.BinaryPlan`` table (gone with the model)."""
    plans = _PLANS.get(model)
    if plans is None:
        plans = _PLANS[model] = {}
    return plans


def _proto_plans(model: ServedModel) -> dict:
    """``model``'s message size -> ``codec.ProtoPlan``s table (gone with the model)."""
    plans = _PROTO_PLANS.get(model)
    if plans is None:
        plans = _PROTO_PLANS[model] = {}
    return plans


def resolve(server: Backend, name: str, version: str | None = None) -> ServedModel:
    """The model that serves ``version`` of ``name`` now, if the server takes inference
    requests: ``NotServing`` while loading or draining, ``UnknownModel`` without one."""
    return serving(server).model(name, version)


def serving(server: Backend) -> Backend:
    """``server``, if it takes inference and generation requests now (else
    ``NotServing``: loading, draining, a broken group)."""
    why = server.not_serving()
    if why:
        raise NotServing(why)
    return server


def resolve_decoder(server: Backend, name: str, version: str | None = None) -> ServedDecoder:
    """The decoder ``name`` serves (``UnknownModel`` without one), if ``version`` (None
    or empty: any) is its version: a decoder serves one version at a time."""
    decoder = server.decoder(name)
    if version and version != decoder.version:
        raise UnknownModel(
            f"model {name!r} has no version {version!r}; serving version {decoder.version}"
        )
    return decoder


def no_decoder_stats(server: Backend, name: str) -> None:
    """``UnknownModel`` saying where a decoder's statistics are, for the statistics
    endpoints (Triton's statistics describe batched requests, not generations)."""
    if server.is_decoder(name):
        raise UnknownModel(
            f"model {name!r} is a decoder: its statistics are in /metrics "
            "(pxrt_generations, pxrt_generated_tokens, pxrt_time_to_first_token_us, "
            "pxrt_time_per_output_token_us, ...)"
        )


@dataclasses.dataclass(slots=True)
class Pending:
    """A request in the queue (``start``'s): the backend, the model's name as the client
    gave it, the model that serves it, the request decoded for it and its future
    (cancelling it takes the request out of the queue if it was not dispatched yet: a
    client that hung up)."""

    server: Backend
    name: str
    model: ServedModel
    request: InferRequest
    future: asyncio.Future

    def finish(self, encode: Callable[[str, Any, InferRequest, dict], T]) -> T:
        """``encode(name, model, request, outputs)``'s reply once the future is done (and
        not cancelled), or the error it is answered with raised (an unexpected one
        counted failed, logged once, raised as ``InternalError``). A request that read
        an input from a segment its client shrank meanwhile (read as zeros) is a 400."""
        try:
            outputs = self.future.result()
            if faults():  # (a segment shrank under a request since start: this one's?)
                check_read(self.request.inputs)
            return encode(self.name, self.model, self.request, outputs)
        except (ServingError, ProtocolError):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug: one line, a 500, the server goes on
            self.server.count(self.name, self.model.version, "failed")
            raise internal_error(f"{self.name!r} inference", exc) from exc

    def cancel(self) -> None:
        self.future.cancel()


@dataclasses.dataclass(slots=True)
class TracedPending(Pending):
    """A request sampled for tracing: ``finish`` also times the encoding and ends its
    span (a class of its own, so untraced requests pay nothing for it)."""

    trace: Trace

    def finish(self, encode: Callable[[str, Any, InferRequest, dict], T]) -> T:
        trace = self.trace
        t0 = _clock()
        try:
            # (not super(): a slots dataclass is a new class, zero-argument super()
            # does not find it on Python 3.11)
            reply = Pending.finish(self, encode)
        except BaseException as exc:
            trace.end(self.model.version, exc, **_attributes(self.request))
            raise
        trace.stage("encode", t0)
        trace.end(self.model.version, None, **_attributes(self.request))
        return reply


_clock = time.perf_counter


def _attributes(request: InferRequest) -> dict:
    rows = next(iter(request.inputs.values())).shape[0] if request.inputs else 0
    return {"pxrt.request_id": request.id or "", "pxrt.rows": int(rows)}


def start(
    server: Backend,
    name: str,
    version: str | None,
    decode: Callable[[Any], InferRequest],
    headers: Any = (),
) -> Pending:
    """The first half of ``infer``, for front ends that do not await: the model resolved
    now, the request ``decode(model)`` makes for it, queued (``Pending.finish`` makes the
    reply once its future is done). ``headers``: the request's (name, value) pairs, read
    only if it is traced (its span continues their W3C ``traceparent``)."""
    tracing = server.tracing
    trace = tracing.begin(name, headers) if tracing is not None else None
    try:
        model = resolve(server, name, version)
        try:
            try:
                request = decode(model)
            except ProtocolError:
                server.count(name, model.version, "invalid")
                raise
            if trace is not None:
                trace.stage("decode", trace.t0)
            try:
                # The version asked for (None: the newest, which is ``model`` here;
                # behind ``pxrt serve --workers``, the newest when the device process
                # takes it, so a reload between the two does not fail the request).
                future = server.submit(
                    name,
                    request.inputs,
                    timeout_s=request.timeout_s,
                    version=version,
                    priority=request.priority,
                    trace=trace,
                )
            except (TypeError, ValueError) as exc:  # the model's validation (counted)
                raise InvalidRequest(str(exc)) from None
        except (ServingError, ProtocolError):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug: one line, a 500, the server goes on
            server.count(name, model.version, "failed")
            raise internal_error(f"{name!r} inference", exc) from exc
    except BaseException as exc:
        if trace is not None:
            trace.end(version or "", exc)
        raise
    if trace is not None:
        return TracedPending(server, name, model, request, future, trace)
    return Pending(server, name, model, request, future)


async def infer(
    server: Backend,
    name: str,
    version: str | None,
    decode: Callable[[Any], InferRequest],
    encode: Callable[[str, Any, InferRequest, dict], T],
    on_queued: Callable[[asyncio.Future], Any] | None = None,
    headers: Any = (),
) -> T:
    """Answer one inference request: ``encode(name, model, request, outputs)`` for the
    request ``decode(model)`` makes for the model resolved now.

    ``on_queued`` gets the request's future once it is queued (cancelling it takes the
    request out of the queue if it was not dispatched: a client that hung up). Raises
    what ``status_of`` maps; an unexpected error is counted failed, logged once and
    raised as ``InternalError``.
    """
    pending = start(server, name, version, decode, headers)
    if on_queued is not None:
        on_queued(pending.future)
    try:
        await pending.future  # cancelled with the caller (the request leaves the queue)
    except Exception:  # noqa: BLE001, S110 - the request's error: finish raises it, mapped
        pass
    return pending.finish(encode)


def answer(exc: BaseException, where: str) -> Status:
    """How ``exc`` is answered, on any transport: an unexpected one (a bug) is logged
    once, as having happened at ``where``, and answered as ``InternalError``; every
    error then maps through ``ERRORS``."""
    if not is_known(exc):
        exc = internal_error(where, exc)
    return status_of(exc)


def internal_error(where: str, exc: BaseException) -> InternalError:
    """The ``InternalError`` an unexpected ``exc`` is answered with, logged (one line)."""
    log.error("pxrt: %s failed: %s: %.200s", printable(where), type(exc).__name__, printable(exc))
    return InternalError(f"internal error: {type(exc).__name__}: {str(exc)[:200]}")


# --------------------------------------------------------------------------- errors


@dataclasses.dataclass(frozen=True, slots=True)
class Status:
    """How an error is answered: HTTP status, gRPC status code name, message, and any
    headers HTTP adds."""

    http: int
    grpc: str
    message: str
    headers: dict[str, str] | None = None


# gRPC's status codes by name (grpc.StatusCode's, without importing grpc).
GRPC_CODES = {
    name: i
    for i, name in enumerate(
        "OK CANCELLED UNKNOWN INVALID_ARGUMENT DEADLINE_EXCEEDED NOT_FOUND ALREADY_EXISTS "
        "PERMISSION_DENIED RESOURCE_EXHAUSTED FAILED_PRECONDITION ABORTED OUT_OF_RANGE "
        "UNIMPLEMENTED INTERNAL UNAVAILABLE DATA_LOSS UNAUTHENTICATED".split()
    )
}

# Every error a front end answers, most specific first: (type, HTTP status, gRPC code).
# The codes are Triton's (a full queue is UNAVAILABLE over gRPC, 429 over HTTP).
ERRORS: tuple[tuple[type[BaseException], int, str], ...] = (
    (Forbidden, 403, "PERMISSION_DENIED"),  # a restricted API without its key
    (KeyRepeated, 400, "INVALID_ARGUMENT"),  # ... or with it more than once
    (TooLarge, 413, "RESOURCE_EXHAUSTED"),
    (UnknownRegion, 404, "NOT_FOUND"),  # a shared memory region nobody registered
    (ProtocolError, 400, "INVALID_ARGUMENT"),  # does not follow the protocol
    (InvalidRequest, 400, "INVALID_ARGUMENT"),  # does not fit the model
    (NoRepository, 400, "FAILED_PRECONDITION"),
    (RepositoryError, 400, "INVALID_ARGUMENT"),
    (UnknownModel, 404, "NOT_FOUND"),
    (Overloaded, 429, "UNAVAILABLE"),
    (NotServing, 503, "UNAVAILABLE"),
    (BodiesFull, 503, "UNAVAILABLE"),
    (ServerClosed, 503, "UNAVAILABLE"),
    (DeadlineExceeded, 504, "DEADLINE_EXCEEDED"),
    (ExecutionFailed, 500, "INTERNAL"),
    (InternalError, 500, "INTERNAL"),
)


def status_of(exc: BaseException) -> Status:
    """How ``exc`` is answered (anything not in ``ERRORS`` is a 500 / INTERNAL whose
    message names its type; the caller logs it with ``internal_error``)."""
    for kind, http, grpc in ERRORS:
        if isinstance(exc, kind):
            headers = None
            if isinstance(exc, Overloaded):
                headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
            elif isinstance(exc, BodiesFull):
                headers = {"Retry-After": "1"}
            return Status(http, grpc, str(exc), headers)
    return Status(500, "INTERNAL", f"internal error: {type(exc).__name__}: {str(exc)[:200]}")


def is_known(exc: BaseException) -> bool:
    """Whether ``exc`` is one of the errors a request may meet (not a bug)."""
    return isinstance(exc, _KNOWN)


_KNOWN = tuple(kind for kind, _, _ in ERRORS)
_BY_NAME = {kind.__name__: kind for kind in _KNOWN}


def error_kind(exc: BaseException) -> str:
    """The name ``exc`` crosses a process boundary as (the workers' link): its kind in
    ``ERRORS``; a model's own validation error (TypeError, ValueError) is
    ``InvalidRequest``; anything else ``InternalError``."""
    kind = next((k for k in _KNOWN if isinstance(exc, k)), None)
    if kind is None:
        kind = InvalidRequest if isinstance(exc, (TypeError, ValueError)) else InternalError
    return kind.__name__


def error_of_kind(kind: str, message: str, retry_after_s: float = 0.0) -> BaseException:
    """The error ``error_kind`` named, made again on the other side."""
    if kind == "Overloaded":
        return Overloaded(message, retry_after_s)
    try:
        return _BY_NAME.get(kind, InternalError)(message)
    except TypeError:  # (one whose message is its own: made anyway)
        return InternalError(message)


__all__ = [
    "ERRORS",
    "GRPC_CODES",
    "BodiesFull",
    "BodyBudget",
    "InferRequest",
    "InternalError",
    "InvalidRequest",
    "NotServing",
    "Pending",
    "Status",
    "TooLarge",
    "Upload",
    "answer",
    "error_kind",
    "error_of_kind",
    "infer",
    "internal_error",
    "is_known",
    "resolve",
    "serving",
    "start",
    "status_of",
]


def is_embedding(model: Any) -> bool:
    """Whether ``model`` (a served model, or a worker's view of one) is an embedding
    model (``/v1/embeddings`` serves it)."""
    got = getattr(model, "embedding", None)
    if got is not None:
        return bool(got)
    return "embedding" in getattr(getattr(model, "artifact", None), "manifest", {})
