"""KServe v2 / Open Inference Protocol over gRPC, on the same loop and ``Server`` as HTTP.

``GRPCService(server)`` implements ``inference.GRPCInferenceService`` with the servicer
base class and messages that Triton's client package ships
(``tritonclient.grpc.service_pb2_grpc``), so the protocol is the one Triton's clients
speak, not a copy of it. ``start_grpc(server, port)`` serves it with grpcio's asyncio
server on the running loop (``pxrt serve --no-native-grpc``; by default ``pxrt serve``
runs ``serving.grpc.native``, which answers inference from its own HTTP/2 frames and
every other method with this class's coroutines). It translates gRPC only: inference
goes through the request core (``serving.kserve.core``), whose error table gives each error its
status code, so gRPC and HTTP answer alike.

Served: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
ModelStatistics, ModelInfer (``raw_input_contents`` or typed ``contents`` in,
``raw_output_contents`` out) and ModelStreamInfer (any number of requests in flight on
one stream, each answered or failed on its own, in completion order, with its ``id``).
RepositoryIndex, RepositoryModelLoad and RepositoryModelUnload drive a
``serving.engine.repository.Repository`` when there is one; shared memory answers UNIMPLEMENTED.

Errors map to status codes as Triton's do: a malformed request or a validation error is
INVALID_ARGUMENT, an unknown model or version NOT_FOUND, a full queue or a server that is
loading or draining UNAVAILABLE, a deadline passed in the queue DEADLINE_EXCEEDED, a
failed batch or an unexpected error INTERNAL, a message over the size limit
RESOURCE_EXHAUSTED (grpcio's own), a message that is not a valid protobuf
INVALID_ARGUMENT (``start_grpc`` parses messages itself: grpcio would answer UNKNOWN
with a Python exception's text).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from ..access import Forbidden, KeyRepeated, Restrictions, TlsFiles
from ..errors import UnknownModel, require
from ..kserve import codec, core, documents, shm
from ..kserve.core import InferRequest
from ..options import GrpcLimits
from ..tracing import NOT_SET_UP

if TYPE_CHECKING:
    from pxrt import Model

    from ..engine.repository import Repository
    from ..engine.server import Server
    from ..tracing import Tracing


log = logging.getLogger("pxrt.grpc")


class GRPCService(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` for the models of ``server`` (and of
    ``repository``, when there is one)."""

    def __init__(
        self,
        server: Server,
        repository: Repository | None = None,
        limits: GrpcLimits | None = None,
        restrictions: Restrictions = Restrictions(),
    ) -> None:
        self.server = server
        self.repository = repository
        self.limits = limits or GrpcLimits()
        self.restrictions = restrictions

    @staticmethod
    async def _abort(context: Any, exc: BaseException, where: str) -> None:
        status = core.answer(exc, where)
        await context.abort(getattr(grpc.StatusCode, status.grpc), status.message)

    # ------------------------------------------------------------------ health, metadata

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.server.not_serving() is None)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        try:
            if self.server.is_decoder(request.name):
                core.resolve_decoder(self.server, request.name, request.version or None)
            else:
                self.server.model(request.name, request.version or None)
        except UnknownModel:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.server.not_serving() is None)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return json_format.ParseDict(documents.server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            if self.server.is_decoder(request.name):
                decoder = core.resolve_decoder(self.server, request.name, request.version or None)
                doc = documents.decoder_metadata(request.name, decoder)
                return json_format.ParseDict(doc, pb.ModelMetadataResponse())
            model = self.server.model(request.name, request.version or None)
            versions = self.server.versions(request.name)
            doc = documents.model_metadata(request.name, model, versions)
            return json_format.ParseDict(doc, pb.ModelMetadataResponse())
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "ModelMetadata")

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        try:
            name, version = request.name, request.version or None
            if self.server.is_decoder(name):
                decoder = core.resolve_decoder(self.server, name, version)
                doc = documents.decoder_config(name, decoder)
                config = json_format.ParseDict(doc, model_config_pb2.ModelConfig())
                return pb.ModelConfigResponse(config=config)
            model = self.server.model(name, version)
            doc = documents.model_config(
                name,
                model,
                self.server.options(name, model.version),
                self.server.max_batch_size(name, model.version),
            )
            if not model.version.isdigit():  # int64 in the message
                doc["version_policy"] = {"latest": {"num_versions": 1}}
            config = json_format.ParseDict(doc, model_config_pb2.ModelConfig())
            return pb.ModelConfigResponse(config=config)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "ModelConfig")

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        try:
            server = self.server
            if request.name:
                core.no_decoder_stats(server, request.name)
                model = server.model(request.name, request.version or None)
                snap = server.stats(request.name, model.version)
                stats = [documents.model_stats(request.name, model.version, snap)]
            else:
                stats = [
                    documents.model_stats(name, model.version, server.stats(name))
                    for name, model in server.models.items()
                ]
            return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "ModelStatistics")

    # ------------------------------------------------------------------ repository

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        try:
            rows = require(self.repository).index()
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "RepositoryIndex")
        if request.ready:
            rows = [r for r in rows if r["state"] == "READY"]
        response = pb.RepositoryIndexResponse()
        for r in rows:
            response.models.add(**r)
        return response

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        try:
            await require(self.repository).load(request.model_name)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "RepositoryModelLoad")
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        try:
            await require(self.repository).unload(request.model_name)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "RepositoryModelUnload")
        return pb.RepositoryModelUnloadResponse()

    # ------------------------------------------------------------------ trace settings

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        """Triton's trace extension (``/v2/trace/setting`` over HTTP): server-wide; an
        update sets the settings it names (an empty value: back to the default)."""
        try:
            settings = _trace_setting(self.server.tracing, request)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "TraceSetting")
        response = pb.TraceSettingResponse()
        for key, value in settings.items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response

    # ------------------------------------------------------------------ shared memory

    def _regions(self, context: Any) -> shm.Regions:
        """The shared memory regions of the key the call holds."""
        return self.server.shared_memory.for_request(self.restrictions, _metadata(context))

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        try:
            regions = self._regions(context).status(request.name or None)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "SystemSharedMemoryStatus")
        response = pb.SystemSharedMemoryStatusResponse()
        for region in regions:
            response.regions[region["name"]].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region)
            )
        return response

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        try:
            self._regions(context).register(
                request.name, request.key, request.offset, request.byte_size,
                local=_local_peer(context.peer()),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "SystemSharedMemoryRegister")
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        try:
            self._regions(context).unregister(request.name or None)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "SystemSharedMemoryUnregister")
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        try:
            shm.no_cuda_region(request.name or None)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "CudaSharedMemoryStatus")
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        try:
            shm.no_cuda_region(request.name, register=True)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "CudaSharedMemoryRegister")
        return pb.CudaSharedMemoryRegisterResponse()  # pragma: no cover - always refused

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        try:
            shm.no_cuda_region(request.name or None)
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "CudaSharedMemoryUnregister")
        return pb.CudaSharedMemoryUnregisterResponse()

    # ------------------------------------------------------------------ inference

    def _infer(
        self, message: pb.ModelInferRequest, deadline_s: float | None, context: Any = None
    ) -> Any:
        if isinstance(message, Malformed):  # in a stream: this request's error
            raise codec.ProtocolError(message.error)

        regions = self.server.shared_memory.open
        if context is not None and "shared-memory" in self.restrictions.keys:
            regions = self.server.shared_memory.for_request(self.restrictions, _metadata(context))

        def decode(model: Model) -> InferRequest:
            return InferRequest.from_proto(message, model, deadline_s, regions)

        headers: Any = ()  # (grpcio's metadata is a call: made only for tracing)
        if self.server.tracing is not None and context is not None:
            headers = context.invocation_metadata() or ()
        return core.infer(
            self.server, message.model_name, message.model_version or None, decode, _encode,
            headers=headers,
        )  # fmt: skip

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        try:
            remaining = context.time_remaining()
            deadline_s = remaining if remaining is not None and remaining > 0 else None
            return await self._infer(request, deadline_s, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - answered with its status code
            await self._abort(context, exc, "ModelInfer")

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> Any:
        """Every request of the stream is queued as it arrives; answers (or errors, as
        ``error_message`` with the request's ``id``) go back as they complete. At most
        ``limits.max_stream_inflight`` requests are read and not yet answered. When the
        server drains, the stream is no longer read: what was read is answered, then
        the stream ends with UNAVAILABLE."""
        if self.restrictions:
            try:
                self.restrictions.check("inference", _metadata(context))
            except (Forbidden, KeyRepeated) as exc:
                await self._abort(context, exc, "ModelStreamInfer")
        done: asyncio.Queue = asyncio.Queue()
        slots = asyncio.Semaphore(self.limits.max_stream_inflight)
        pending = 0
        reading = True

        async def one(request: pb.ModelInferRequest) -> None:
            try:
                if self.server.is_decoder(request.model_name):
                    await generate(request)
                    return
                response = await self._infer(request, None, context)
                done.put_nowait(pb.ModelStreamInferResponse(infer_response=response))
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the stream is ending: nobody reads the answer
                # the request was cancelled, not this task (its model closing): it is
                # answered like any failed one, or the stream would wait for it forever
                done.put_nowait(_stream_error(request, f"the request was cancelled: {exc}"))
            except Exception as exc:  # noqa: BLE001 - this request's answer
                done.put_nowait(
                    _stream_error(request, core.answer(exc, "ModelStreamInfer").message)
                )

        async def generate(request: pb.ModelInferRequest) -> None:
            """A decoupled request: a response per token, then the final one; only the
            last one counts as the request's answer."""
            from ..kserve.generation_grpc import FINAL, responses

            headers: Any = ()  # (grpcio's metadata is a call: made only for tracing)
            if self.server.tracing is not None:
                headers = context.invocation_metadata() or ()
            async for response in responses(self.server, request, headers):
                if response.infer_response.parameters[FINAL].bool_param:
                    done.put_nowait(response)
                else:
                    done.put_nowait((response, False))

        tasks: set[asyncio.Task] = set()

        async def read() -> None:
            nonlocal pending, reading
            requests = aiter(request_iterator)
            try:
                while True:
                    await slots.acquire()  # at the cap: not read until an answer is written
                    try:
                        request = await anext(requests)
                    except StopAsyncIteration:
                        break
                    pending += 1
                    task = asyncio.ensure_future(one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                reading = False
                done.put_nowait(None)  # wakes the writer to check whether all is done

        reader = asyncio.ensure_future(read())
        draining = asyncio.ensure_future(self.server.wait_draining())
        draining.add_done_callback(lambda _: reader.cancel())
        try:
            while reading or pending:
                item = await done.get()
                if item is None:
                    continue
                if isinstance(item, tuple):  # one of a decoupled request's responses
                    yield item[0]
                    continue
                pending -= 1
                yield item
                slots.release()
            if draining.done() and not draining.cancelled() and reader.cancelled():
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.server.not_serving())
        finally:
            draining.cancel()
            reader.cancel()
            for task in list(tasks):
                task.cancel()


class Malformed:
    """A request message that did not parse: what ``start_grpc``'s parser hands the
    servicer instead of raising (the error goes back as INVALID_ARGUMENT)."""

    model_name = id = ""

    def __init__(self, message_type: str) -> None:
        self.error = f"malformed {message_type}: the message is not a valid protobuf"


def _parser(message_class: Any) -> Any:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return Malformed(message_class.DESCRIPTOR.name)

    return parse


# The API group (``serving.access``) of each method that can be restricted.
GROUPS = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelConfig": "metadata",
    "ModelStatistics": "statistics",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "TraceSetting": "trace",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
}


def _metadata(context: Any) -> Callable[[str], list[str]]:
    """A call's metadata values by (lower-case) key (``Restrictions.check``'s)."""
    pairs = list(context.invocation_metadata() or ())
    return lambda name: [v for k, v in pairs if k == name]


def _local_peer(peer: Any) -> bool:
    """Whether a call's ``peer`` (gRPC's form: ``ipv4:127.0.0.1:port``,
    ``ipv6:[::1]:port``, its brackets maybe %-escaped, ``unix:path``) is on this host."""
    if not isinstance(peer, str):
        return False
    scheme, _, address = peer.partition(":")
    if scheme.startswith("unix"):
        return True
    if scheme not in ("ipv4", "ipv6"):
        return False
    return shm.local_peer(unquote(address).rpartition(":")[0])


def _checked(method: Any, group: str | None, restrictions: Restrictions) -> Any:
    """A unary method that answers a malformed request INVALID_ARGUMENT, and one of a
    restricted group without its key PERMISSION_DENIED."""
    restricted = group is not None and group in restrictions.keys

    async def call(request: Any, context: Any) -> Any:
        if restricted:
            assert group is not None
            try:
                restrictions.check(group, _metadata(context))
            except (Forbidden, KeyRepeated) as exc:
                status = core.status_of(exc)
                await context.abort(getattr(grpc.StatusCode, status.grpc), status.message)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await method(request, context)

    return call


def add_service(service: GRPCService, grpc_server: grpc.aio.Server) -> None:
    """Register ``service``'s methods on ``grpc_server``, as the generated
    ``add_GRPCInferenceServiceServicer_to_server`` does but parsing each request itself
    (a malformed one is INVALID_ARGUMENT, not grpcio's UNKNOWN)."""
    descriptor = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in descriptor.methods:
        parse = _parser(getattr(pb, method.input_type.name))
        serialize = getattr(pb, method.output_type.name).SerializeToString
        impl = getattr(service, method.name)
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                impl, request_deserializer=parse, response_serializer=serialize
            )
        elif not method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _checked(impl, GROUPS.get(method.name), service.restrictions),
                request_deserializer=parse,
                response_serializer=serialize,
            )
        else:  # pragma: no cover - the KServe v2 service has no such method
            raise TypeError(f"{method.full_name}: only unary and bidirectional methods")
    grpc_server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(descriptor.full_name, handlers),)
    )
    grpc_server.add_registered_method_handlers(descriptor.full_name, handlers)


def _encode(name: str, model: Model, request: InferRequest, outputs: dict) -> Any:
    """The ModelInferResponse: every output as raw bytes (or written to shared memory)."""
    if not codec.inline(request.outputs):
        return shm_response(name, model.version, request.id, outputs, request.outputs)
    response = pb.ModelInferResponse(model_name=name, model_version=model.version, id=request.id)
    for name, _ in request.outputs:
        arr = outputs[name]
        response.outputs.add(name=name, datatype=codec.datatype_of(arr.dtype), shape=arr.shape)
        response.raw_output_contents.append(np.ascontiguousarray(arr).tobytes())
    return response


def _trace_setting(tracing: Tracing | None, request: Any) -> dict:
    """The settings after ``request`` (a TraceSettingRequest) is applied."""
    if request.model_name:
        raise codec.ProtocolError(
            f"trace settings are server-wide here: no per-model settings (for model "
            f"{request.model_name[:80]!r}); send the request without model_name"
        )
    if request.settings:
        if tracing is None:
            raise codec.ProtocolError(NOT_SET_UP)
        # Each value as its list of strings (a setting of one value takes a list of
        # one: ``Tracing.update`` refuses more); an empty value is None (left as it is),
        # but Triton's default for the rate and the count.
        update: dict = {key: list(v.value) or None for key, v in request.settings.items()}
        for key, default in (("trace_rate", "1000"), ("trace_count", "-1")):
            if update.get(key, "") is None:
                update[key] = default
        try:
            return tracing.update(update)
        except ValueError as exc:
            raise codec.ProtocolError(str(exc)) from None
    if tracing is None:
        return {"trace_level": ["OFF"], "trace_mode": "opentelemetry"}
    return tracing.settings()


def shm_response(
    name: str, version: str, request_id: str | None, outputs: dict, selected: list
) -> Any:
    """A ModelInferResponse where some outputs go to shared memory: those are written to
    their region and answered with an empty raw_output_contents (as Triton's: the
    contents stay one per output, by position, as clients read them); the rest are raw."""
    response = pb.ModelInferResponse(model_name=name, model_version=version, id=request_id)
    for out_name, where in selected:
        arr = np.ascontiguousarray(outputs[out_name])
        response.outputs.add(name=out_name, datatype=codec.datatype_of(arr.dtype), shape=arr.shape)
        if where.__class__ is bool:
            response.raw_output_contents.append(arr.tobytes())
        else:
            where.write(out_name, arr)
            response.raw_output_contents.append(b"")
    return response


def _stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    """A stream's answer to a request that failed: its error and its id."""
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id),
    )


async def start_grpc(
    server: Server,
    port: int,
    *,
    host: str = "127.0.0.1",
    max_message_bytes: int,
    repository: Repository | None = None,
    limits: GrpcLimits = GrpcLimits(),
    restrictions: Restrictions = Restrictions(),
    tls: TlsFiles | None = None,
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
    service = GRPCService(server, repository, limits, restrictions)
    add_service(service, grpc_server)
    address = f"{host}:{port}"
    if tls is not None:
        bound = grpc_server.add_secure_port(address, tls.grpc_credentials())
    else:
        bound = grpc_server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await grpc_server.start()
    return grpc_server
