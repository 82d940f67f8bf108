"""KServe v2 / Open Inference Protocol over gRPC, on the same loop and ``Server`` as HTTP.

``GRPCService(server, state)`` implements ``inference.GRPCInferenceService`` with the
servicer base class and messages that Triton's client package ships
(``tritonclient.grpc.service_pb2_grpc``), so the protocol is the one Triton's clients
speak, not a copy of it. ``start_grpc(server, port, state)`` serves it with grpcio's
asyncio server on the running loop.

Served: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
ModelStatistics, ModelInfer (``raw_input_contents`` or typed ``contents`` in,
``raw_output_contents`` out) and ModelStreamInfer (any number of requests in flight on
one stream, each answered or failed on its own, in completion order, with its ``id``).
RepositoryIndex, RepositoryModelLoad and RepositoryModelUnload drive a
``serving.repository.Repository`` when there is one; shared memory answers UNIMPLEMENTED.

Errors map to status codes as Triton's do: a malformed request or a validation error is
INVALID_ARGUMENT, an unknown model or version NOT_FOUND, a full queue or a server that is
loading or draining UNAVAILABLE, a deadline passed in the queue DEADLINE_EXCEEDED, a
failed batch INTERNAL, a message over the size limit RESOURCE_EXHAUSTED (grpcio's own).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from . import kserve
from .errors import DeadlineExceeded, ExecutionFailed, Overloaded, ServerClosed, UnknownModel
from .server import Server

log = logging.getLogger("pxrt.grpc")

# Typed contents: the field each datatype's elements travel in. FP16 and BF16 have none
# (the protocol sends them as raw bytes only).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


@dataclasses.dataclass(frozen=True)
class GrpcLimits:
    """What one client may hold of the gRPC listener (grpc core enforces each).

    - ``max_connections``: connections open at once; grpc closes new ones beyond it at
      once (``pxrt serve`` gives gRPC a share of its one connection budget).
    - ``handshake_timeout_s``: from connecting to the client's HTTP/2 settings; a socket
      that sends nothing is closed after it.
    - ``idle_timeout_s``: a connection with no call for this long is sent GOAWAY and
      closed (clients reconnect when they next call).
    - ``keepalive_s``, ``keepalive_timeout_s``: a connection with calls but quiet this
      long is pinged; one whose peer does not answer in the timeout is closed.
    - ``min_client_ping_s``: clients pinging more often than this without data are sent
      GOAWAY after two strikes (grpc's keepalive enforcement; Triton's default too).
    """

    max_connections: int = 250
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    keepalive_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_client_ping_s: float = 300.0

    def options(self) -> list[tuple[str, int]]:
        """grpc channel arguments enforcing these limits."""
        ms = lambda s: max(1, int(s * 1000))  # noqa: E731
        return [
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_timeout_s)),
            ("grpc.max_connection_idle_ms", ms(self.idle_timeout_s)),
            ("grpc.keepalive_time_ms", ms(self.keepalive_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", ms(self.min_client_ping_s)),
            ("grpc.http2.max_ping_strikes", 2),
        ]


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code (and message) an error is answered with."""
    if isinstance(exc, _Abort):
        return exc.code, str(exc)
    if isinstance(exc, UnknownModel):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, (TypeError, ValueError)):  # ProtocolError, validation, too large
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, Overloaded):  # Triton answers a full queue UNAVAILABLE too
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, DeadlineExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, ServerClosed):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, ExecutionFailed):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {str(exc)[:200]}"


def decode_inputs(request: pb.ModelInferRequest, specs: dict) -> dict[str, np.ndarray]:
    """The request's inputs as arrays (raw ones are views of the message's bytes).
    Nothing is cast: typed contents must fit their datatype's range exactly."""
    raw = request.raw_input_contents
    if not request.inputs:
        raise kserve.ProtocolError("the request has no inputs")
    if len(request.inputs) > len(specs):
        raise kserve.ProtocolError(
            f"the request has {len(request.inputs)} inputs; the model takes {len(specs)}"
        )
    if raw and len(raw) != len(request.inputs):
        raise kserve.ProtocolError(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give every "
            "input's data raw, or every input's as contents"
        )
    out: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name not in specs:
            raise kserve.ProtocolError(
                f"unexpected input {name[:60]!r}; the model takes {', '.join(map(repr, specs))}"
            )
        if name in out:
            raise kserve.ProtocolError(f"input {name!r} is given twice")
        dtype = kserve._dtype(name, tensor.datatype)
        shape = kserve._shape(name, list(tensor.shape))
        count = math.prod(shape)
        if raw:
            data = raw[i]
            if len(data) != count * dtype.itemsize:
                raise kserve.ProtocolError(
                    f"input {name!r}: shape {list(shape)} of {tensor.datatype} needs "
                    f"{count * dtype.itemsize} bytes, raw_input_contents has {len(data)}"
                )
            out[name] = np.frombuffer(data, dtype).reshape(shape)
            continue
        field = _CONTENTS.get(tensor.datatype)
        if field is None:
            raise kserve.ProtocolError(
                f"input {name!r}: {tensor.datatype} has no typed contents; send it as "
                "raw_input_contents"
            )
        values = getattr(tensor.contents, field)
        if len(values) != count:
            raise kserve.ProtocolError(
                f"input {name!r}: shape {list(shape)} needs {count} elements, contents.{field} "
                f"has {len(values)}"
            )
        wide = np.array(values, dtype=np.float64 if dtype.kind == "f" else None)
        if dtype.kind in "iu" and count:
            info = np.iinfo(dtype)
            if wide.min() < info.min or wide.max() > info.max:
                raise kserve.ProtocolError(
                    f"input {name!r}: contents out of range for {tensor.datatype}"
                )
        out[name] = wide.astype(dtype).reshape(shape)
    return out


def _timeout(request: pb.ModelInferRequest, context: Any) -> float | None:
    """The request's deadline: its ``timeout`` parameter (microseconds, as Triton's), or
    else the call's own gRPC deadline."""
    if "timeout" in request.parameters:
        param = request.parameters["timeout"]
        value = param.int64_param if param.WhichOneof("parameter_choice") else 0
        if value <= 0:
            raise kserve.ProtocolError("parameters.timeout must be a positive int64 (us)")
        return value * 1e-6
    remaining = context.time_remaining() if context is not None else None
    return remaining if remaining is not None and remaining > 0 else None


class GRPCService(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` for the models of ``server``."""

    def __init__(self, server: Server, state: Any, repository: Any = None) -> None:
        self.server = server
        self.state = state
        self.repository = repository

    # ------------------------------------------------------------------ helpers

    def _not_serving(self) -> str | None:
        if self.state.draining:
            return "the server is draining; not accepting inference requests"
        if not self.state.ready:
            return "the server is loading; not accepting inference requests"
        return None

    def _model(self, name: str, version: str) -> tuple[Any, Any]:
        batcher = self.server.batcher(name, version or None)  # UnknownModel -> NOT_FOUND
        return batcher.model, batcher

    @staticmethod
    async def _abort(context: Any, exc: BaseException) -> None:
        code, message = status_of(exc)
        if code == grpc.StatusCode.INTERNAL and not isinstance(exc, (_Abort, ExecutionFailed)):
            log.error("pxrt: a gRPC call failed: %s: %.200s", type(exc).__name__, exc)
        await context.abort(code, message)

    # ------------------------------------------------------------------ health, metadata

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self._not_serving() is None)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        try:
            self._model(request.name, request.version)
        except (UnknownModel, _Abort):
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self._not_serving() is None)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return json_format.ParseDict(kserve.server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            model, _ = self._model(request.name, request.version)
            doc = kserve.model_metadata(request.name, model, self.server.versions(request.name))
            return json_format.ParseDict(doc, pb.ModelMetadataResponse())
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        try:
            model, batcher = self._model(request.name, request.version)
            doc = kserve.model_config(request.name, model, batcher)
            versions = doc["version_policy"]["specific"]["versions"]
            if not all(v.isdigit() for v in versions):  # int64 in the message
                doc["version_policy"] = {"latest": {"num_versions": 1}}
            config = json_format.ParseDict(doc, model_config_pb2.ModelConfig())
            return pb.ModelConfigResponse(config=config)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        try:
            snap = self.server.metrics_snapshot()
            if request.name:
                model, _ = self._model(request.name, request.version)
                stats = [kserve.model_stats(request.name, model, snap[request.name])]
            else:
                stats = [
                    kserve.model_stats(name, model, snap[name])
                    for name, model in self.server.models.items()
                ]
            return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc)

    # ------------------------------------------------------------------ repository

    def _repo(self) -> Any:
        if self.repository is None:
            raise _Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no model repository: start pxrt serve with --model-repository DIR",
            )
        return self.repository

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        try:
            rows = self._repo().index()
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc)
        if request.ready:
            rows = [r for r in rows if r["state"] == "READY"]
        response = pb.RepositoryIndexResponse()
        for r in rows:
            response.models.add(**r)
        return response

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        try:
            await self._repo().load(request.model_name)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        try:
            await self._repo().unload(request.model_name)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc)
        return pb.RepositoryModelUnloadResponse()

    # ------------------------------------------------------------------ inference

    async def _infer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        why = self._not_serving()
        if why:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, why)
        name = request.model_name
        model, batcher = self._model(name, request.model_version)
        try:
            inputs = decode_inputs(request, model.inputs)
            names = list(model.outputs)
            wanted = [o.name for o in request.outputs] or names
            unknown = [n for n in wanted if n not in model.outputs]
            if unknown:
                raise kserve.ProtocolError(
                    f"unknown output {unknown[0][:60]!r}; the model has {', '.join(names)}"
                )
            timeout_s = _timeout(request, context)
        except kserve.ProtocolError:
            batcher.count("invalid")
            raise
        outputs = await self.server.infer(name, inputs, timeout_s=timeout_s, version=model.version)
        response = pb.ModelInferResponse(
            model_name=name, model_version=model.version, id=request.id
        )
        for out_name in wanted:
            arr = outputs[out_name]
            response.outputs.add(
                name=out_name, datatype=kserve.datatype_of(arr.dtype), shape=arr.shape
            )
            response.raw_output_contents.append(np.ascontiguousarray(arr).tobytes())
        return response

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        try:
            return await self._infer(request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc)

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> Any:
        """Every request of the stream is queued as it arrives; answers (or errors, as
        ``error_message`` with the request's ``id``) go back as they complete."""
        done: asyncio.Queue = asyncio.Queue()
        pending = 0
        reading = True

        async def one(request: pb.ModelInferRequest) -> None:
            try:
                response = await self._infer(request, None)
                await done.put(pb.ModelStreamInferResponse(infer_response=response))
            except asyncio.CancelledError as exc:
                if asyncio.current_task().cancelling():
                    raise  # the stream is ending: nobody reads the answer
                # the request was cancelled, not this task (its model closing): it is
                # answered like any failed one, or the stream would wait for it forever
                await done.put(_stream_error(request, f"the request was cancelled: {exc}"))
            except Exception as exc:  # noqa: BLE001 - this request's answer
                await done.put(_stream_error(request, status_of(exc)[1]))

        tasks: set[asyncio.Task] = set()

        async def read() -> None:
            nonlocal pending, reading
            try:
                async for request in request_iterator:
                    pending += 1
                    task = asyncio.ensure_future(one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                reading = False
                await done.put(None)  # wakes the writer to check whether all is done

        reader = asyncio.ensure_future(read())
        try:
            while reading or pending:
                item = await done.get()
                if item is None:
                    continue
                pending -= 1
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


def _stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    """A stream's answer to a request that failed: its error and its id."""
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id),
    )


async def start_grpc(
    server: Server,
    port: int,
    state: Any,
    *,
    host: str = "127.0.0.1",
    max_message_bytes: int,
    repository: Any = None,
    limits: GrpcLimits = GrpcLimits(),
) -> grpc.aio.Server:
    """Serve ``GRPCService`` on ``host:port`` with grpcio's asyncio server on the running
    loop, within ``limits``; returns the started server (``await it.stop(grace)`` to
    stop it)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *limits.options(),
    ]
    grpc_server = grpc.aio.server(options=options)
    service = GRPCService(server, state, repository)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(service, grpc_server)
    if grpc_server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await grpc_server.start()
    return grpc_server
