"""KServe v2 / Open Inference Protocol over HTTP: a mountable Starlette app.

``create_app(server)`` serves the models of a ``serving.Server``: health, metadata,
Triton-style model config and statistics, inference with JSON or binary tensors, the
model repository when there is one, and ``/metrics`` in Prometheus text format. The
endpoints translate HTTP only: inference goes through the request core
(``serving.kserve.core``), whose error table gives each error its status, so HTTP and gRPC
answer alike. Errors come back as ``{"error": "..."}``: 400 for a malformed request or a
validation error, 404 for an unknown model, version or path, 405 for a wrong method, 413
for a body (or its JSON part) over the limit (refused before it is read), 429 with
``Retry-After`` when the queue is full, 503 while loading or draining or when the app
already holds its budget of request bodies, 504 when the request's deadline passed in
the queue, 500 when its batch failed or anything unexpected happened (logged in one
line). A client that hangs up takes its request out of the queue if it was not
dispatched yet. Limits on connections, header sizes and slow clients are the HTTP
protocol's (``serving.http.limits``), which ``pxrt serve`` uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from ..access import Restrictions
from ..errors import RepositoryError, ServingError, require
from ..kserve import codec, core, documents, embeddings, generation, shm
from ..kserve.codec import ProtocolError
from ..kserve.core import BodiesFull, BodyBudget, InferRequest, TooLarge, Upload
from ..options import HttpLimits
from ..tracing import NOT_SET_UP

if TYPE_CHECKING:
    from ..engine.repository import Repository
    from ..engine.server import Server
    from ..kserve.backend import Backend, ServedModel
    from ..kserve.shm import Regions


log = logging.getLogger("pxrt.http")

HEADER_LENGTH = "inference-header-content-length"

# The ASGI scope extension through which the app learns that a client hung up: a
# function taking a callback, called (on the loop) if the connection is lost before the
# response is complete. No task per request waiting on receive(). ``pxrt serve``'s
# protocol (``serving.http.limits``) provides it.
DISCONNECT_EXTENSION = "pxrt.on_disconnect"


@dataclasses.dataclass
class AppState:
    """What the endpoints serve: ``app.state.pxrt`` (the native path serves the same).
    ``server`` answers inference and generation (the data plane: a ``Server``, or a
    worker's ``RemoteServer``); ``control`` the rest (``create_app``'s ``Server``;
    None in a ``--workers`` worker, which forwards those requests)."""

    server: Backend
    limits: HttpLimits
    budget: BodyBudget
    repository: Repository | None
    restrictions: Restrictions
    control: Server | None = None


def create_app(
    server: Server,
    *,
    limits: HttpLimits = HttpLimits(),
    lifespan: Any = None,
    repository: Repository | None = None,
    restrictions: Restrictions = Restrictions(),
) -> KServeApp:
    """A Starlette app speaking KServe v2 for ``server``'s models.

    Mount it in your own ASGI app, or run it with uvicorn (``pxrt serve`` does). It
    takes inference requests while ``server.ready`` and not ``server.draining``. Of
    ``limits`` the app enforces the body sizes; the connection and timing limits are
    the protocol's (``serving.http.limits.guarded_protocol``). ``restrictions``: the API
    groups that answer only requests carrying their key (``serving.access``).
    """
    state = AppState(
        server, limits, BodyBudget(limits.max_pending_body_bytes), repository, restrictions, server
    )
    infer = InferEndpoint(state)
    app = Starlette(
        routes=_routes(restrictions, infer), lifespan=lifespan, exception_handlers=_handlers()
    )
    # Starlette answers a path with a trailing slash by a redirect built from the
    # request's Host header (an open redirect); the API's paths have none: a 404.
    app.router.redirect_slashes = False
    app.state.pxrt = state
    return KServeApp(app, infer)


def generation_app(state: AppState, fallback: Any) -> Starlette:
    """The generation endpoints (generate extension, OpenAI completions) over
    ``state.server``, and ``fallback`` (an ASGI app) for every other request: a
    ``--workers`` worker's app, which streams its generations itself."""
    routes = [*_generation_routes(state.restrictions), Mount("", app=fallback)]
    app = Starlette(routes=routes, exception_handlers=_handlers())
    app.router.redirect_slashes = False  # (as create_app's)
    app.state.pxrt = state
    return app


def _handlers() -> dict[Any, Callable]:
    handlers: dict[Any, Callable] = {HTTPException: _routing_error}
    handlers.update({kind: _error_response for kind, _, _ in core.ERRORS})
    return handlers


# --------------------------------------------------------------------------- fast routes

_MODELS = "/v2/models/"


def fast_route(method: str, path: str) -> tuple[str, str, str | None] | None:
    """``(kind, model, version)`` of a request answered without routing (inference, and
    on ``pxrt serve``'s native path health too; ``path`` decoded), else None."""
    if method == "POST":
        if not (path.startswith(_MODELS) and path.endswith("/infer")):
            return None
        parts = path[len(_MODELS) : -len("/infer")].split("/")
        if len(parts) == 1 and parts[0]:
            return "inference", parts[0], None
        if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
            return "inference", parts[0], parts[2]
        return None
    if method == "GET":
        if path == "/v2/health/live":
            return "live", "", None
        if path == "/v2/health/ready":
            return "ready", "", None
    return None


class KServeApp:
    """The ASGI app ``create_app`` returns: inference requests go straight to their
    endpoint (``InferEndpoint``), without Starlette's routing, request and response
    objects; everything else to the Starlette app (``app``: mount routes on it, read
    ``state``). What it saves is what Ray Serve's replicas and anyone mounting the app
    in their own server pay per request."""

    def __init__(self, app: Any, infer: InferEndpoint) -> None:
        self.app = app  # an ASGI app (``create_app``'s: the Starlette app)
        self.state = getattr(app, "state", None)
        self.infer = infer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            root = scope.get("root_path", "")
            if root and path.startswith(root):  # mounted: the path below the mount
                path = path[len(root) :]
            found = fast_route("POST", path)
            if found is not None:
                scope["path_params"] = (
                    {"model": found[1]}
                    if found[2] is None
                    else {"model": found[1], "version": found[2]}
                )
                await self.infer(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------- responses


def _json(doc: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY),
        status,
        headers,
        media_type="application/json",
    )


def error_reply(
    exc: BaseException, server: Backend, where: str = "HTTP"
) -> tuple[int, dict, dict[str, str] | None]:
    """How an error is answered over HTTP (both paths): status, JSON document, headers
    (``core.answer``'s: an unexpected one logged once, as at ``where``)."""
    status = core.answer(exc, where)
    headers = status.headers
    if isinstance(exc, core.NotServing) and server.draining:
        # Draining: the client should go elsewhere, not send its next request here.
        headers = {**(headers or {}), "Connection": "close"}
    return status.http, {"error": status.message}, headers


def readiness(server: Backend) -> tuple[int, dict]:
    """``/v2/health/ready``'s status and document."""
    why = server.not_serving()
    if why:
        return 503, {"ready": False, "error": why}
    return 200, {"ready": True}


async def _error_response(request: Request, exc: Exception) -> Response:
    status, doc, headers = error_reply(exc, _state(request).server)
    return _json(doc, status, headers)


async def _routing_error(request: Request, exc: Exception) -> Response:
    # Starlette's own 404/405 (no route, wrong method), as every other error: JSON.
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404 and request.url.path.startswith("/v1/"):
        return generation.openai_not_found(f"no endpoint {request.url.path!r:.200} under /v1")
    if exc.status_code == 404:
        message = f"no endpoint {request.url.path!r}; the API is KServe v2 under /v2"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
    else:
        message = str(exc.detail)
    return _json({"error": message}, exc.status_code, exc.headers)


def _endpoint(fn: Callable[[Request], Awaitable[Response]]) -> Callable:
    """An endpoint whose unexpected errors are answered like the known ones: a JSON 500,
    one log line, the connection kept. A client that hangs up before its request is in
    is not an error: one line at INFO, and nobody to answer."""

    @functools.wraps(fn)
    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except (ServingError, ProtocolError, RepositoryError, asyncio.CancelledError):
            raise  # the app's exception handlers answer these
        except ClientDisconnect:
            log.info("pxrt: %s %s: the client hung up", request.method, request.url.path)
            return Response(status_code=499)  # (not sent: the connection is gone)
        except Exception as exc:  # noqa: BLE001 - a bug: logged, answered, serving goes on
            raise core.internal_error(f"{request.method} {request.url.path}", exc) from exc

    return endpoint


def _restricted(
    restrictions: Restrictions, group: str, endpoint: Callable[[Request], Awaitable[Response]]
) -> Callable:
    """``endpoint``, answering 403 (``Forbidden``) without the key when ``group`` is
    restricted (else ``endpoint`` itself: an open group costs nothing)."""
    if group not in restrictions.keys:
        return endpoint

    @functools.wraps(endpoint)
    async def guarded(request: Request) -> Response:
        restrictions.check(group, request.headers.getlist)
        return await endpoint(request)

    return guarded


def _state(request: Request) -> AppState:
    return request.app.state.pxrt


def _control(request: Request) -> Server:
    """The ``Server`` behind the control endpoints (statistics, configuration)."""
    control = _state(request).control
    assert control is not None, "a control endpoint without a Server (a worker forwards them)"
    return control


def _decoder(request: Request) -> tuple[str, Any] | None:
    """``(name, decoder)`` when the request's model is a decoder (its version must be the
    one served), else None."""
    server = _state(request).server
    name = request.path_params["model"]
    if not server.is_decoder(name):
        return None
    return name, core.resolve_decoder(server, name, request.path_params.get("version"))


def _model(request: Request) -> tuple[str, ServedModel]:
    name = request.path_params["model"]
    return name, _state(request).server.model(name, request.path_params.get("version"))


# --------------------------------------------------------------------------- health, metadata


@_endpoint
async def server_metadata(request: Request) -> Response:
    return _json(documents.server_metadata())


@_endpoint
async def live(request: Request) -> Response:
    return _json({"live": True})


@_endpoint
async def ready(request: Request) -> Response:
    status, doc = readiness(_state(request).server)
    return _json(doc, status)


@_endpoint
async def model_ready(request: Request) -> Response:
    name, _ = _decoder(request) or _model(request)
    why = _state(request).server.not_serving()
    if why:
        return _json({"name": name, "ready": False, "error": why}, 503)
    return _json({"name": name, "ready": True})


@_endpoint
async def model_metadata(request: Request) -> Response:
    decoder = _decoder(request)
    if decoder is not None:
        return _json(documents.decoder_metadata(*decoder))
    name, model = _model(request)
    return _json(documents.model_metadata(name, model, _state(request).server.versions(name)))


@_endpoint
async def model_config(request: Request) -> Response:
    server = _control(request)
    decoder = _decoder(request)
    if decoder is not None:
        return _json(documents.decoder_config(*decoder))
    name = request.path_params["model"]
    model = server.model(name, request.path_params.get("version"))
    return _json(
        documents.model_config(
            name,
            model,
            server.options(name, model.version),
            server.max_batch_size(name, model.version),
        )
    )


@_endpoint
async def model_stats(request: Request) -> Response:
    core.no_decoder_stats(_state(request).server, request.path_params["model"])
    name, model = _model(request)
    snap = _control(request).stats(name, model.version)
    return _json({"model_stats": [documents.model_stats(name, model.version, snap)]})


@_endpoint
async def all_stats(request: Request) -> Response:
    server = _control(request)
    stats = [
        documents.model_stats(name, model.version, server.stats(name))
        for name, model in server.models.items()
    ]
    return _json({"model_stats": stats})


@_endpoint
async def trace_setting(request: Request) -> Response:
    """Triton's trace extension, server-wide: GET the settings, POST a change."""
    tracing = _control(request).tracing
    if request.method == "POST":
        doc = codec.parse_json(await request.body())
        if tracing is None:
            raise ProtocolError(NOT_SET_UP)
        try:
            return _json(tracing.update(doc))
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
    if tracing is None:
        return _json({"trace_level": ["OFF"], "trace_mode": "opentelemetry"})
    return _json(tracing.settings())


# --------------------------------------------------------------------------- shared memory


@_endpoint
async def shm_register(request: Request) -> Response:
    """Triton's system shared memory extension: register a region (``serving.kserve.shm``)."""
    state = _state(request)
    length = request.headers.get("content-length")
    upload = Upload(state.budget, state.limits.max_json_bytes, length)
    try:
        doc = codec.parse_json(await upload.read(request.stream()))
    finally:
        upload.release()
    if not isinstance(doc, dict):
        raise ProtocolError("the request must be a JSON object with key, offset and byte_size")
    unknown = set(doc) - {"key", "offset", "byte_size"}
    if unknown:
        raise ProtocolError(f"unknown fields {sorted(unknown)}; expected key, offset, byte_size")
    name = request.path_params["region"]
    client = request.client
    _regions(request).register(
        name, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"),
        local=shm.local_peer(client.host if client is not None else None),
    )  # fmt: skip
    return _json({})


@_endpoint
async def shm_unregister(request: Request) -> Response:
    _regions(request).unregister(request.path_params.get("region"))
    return _json({})


@_endpoint
async def shm_status(request: Request) -> Response:
    return _json(_regions(request).status(request.path_params.get("region")))


def _regions(request: Request) -> Regions:
    """The shared memory regions of the key the request holds (``shm.Regions``)."""
    return _control(request).shared_memory.for_request(
        _state(request).restrictions, request.headers.getlist
    )


@_endpoint
async def cuda_shm(request: Request) -> Response:
    """Triton's CUDA shared memory extension: none is served (``shm.no_cuda_region``)."""
    name = request.path_params.get("region")
    shm.no_cuda_region(name, register=request.url.path.endswith("/register"))
    return _json([] if request.url.path.endswith("/status") else {})


@_endpoint
async def metrics(request: Request) -> Response:
    registry = _control(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


# --------------------------------------------------------------------------- repository


@_endpoint
async def repository_index(request: Request) -> Response:
    state = _state(request)
    rows = require(state.repository).index()
    length = request.headers.get("content-length")
    upload = Upload(state.budget, state.limits.max_json_bytes, length)
    try:
        body = await upload.read(request.stream())
    finally:
        upload.release()
    if body:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ProtocolError(f"malformed JSON in the request: {exc}") from None
        if isinstance(doc, dict) and doc.get("ready") is True:
            rows = [r for r in rows if r["state"] == "READY"]
    return _json(rows)


@_endpoint
async def repository_load(request: Request) -> Response:
    await require(_state(request).repository).load(request.path_params["model"])
    return _json({})


@_endpoint
async def repository_unload(request: Request) -> Response:
    await require(_state(request).repository).unload(request.path_params["model"])
    return _json({})


# --------------------------------------------------------------------------- inference


class InferEndpoint:
    """``POST /v2/models/{model}[/versions/{version}]/infer`` as a raw ASGI endpoint (the
    Starlette route's, and ``KServeApp``'s without routing): the body is gathered within
    the per-request limit and the app's budget (``Upload``), the request core answers it,
    and the reply is sent as one response start and one body. A client that hangs up
    takes its request out of the queue if it was not dispatched yet: ``pxrt serve``'s
    protocol reports that through a scope extension; under another server, a pending
    ``receive()`` per request does."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        state = self.state
        try:
            await self._infer(state, scope, receive, send)
        except _Sent:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - answered by the error table
            status, doc, headers = error_reply(exc, state.server, f"POST {scope.get('path', '')}")
            await _send(send, status, orjson.dumps(doc), headers, "application/json")

    async def _infer(self, state: AppState, scope: Any, receive: Any, send: Any) -> None:
        headers = Headers(scope=scope)
        if "inference" in state.restrictions.keys:
            state.restrictions.check("inference", headers.getlist)
        server = state.server
        params = scope["path_params"]
        name, version = params["model"], params.get("version")
        core.resolve(server, name, version)  # loading, draining, unknown: before the body
        upload = Upload(state.budget, state.limits.max_body_bytes, headers.get("content-length"))
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Sent  # nobody to answer
                upload.add(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            regions = server.shared_memory.for_request(state.restrictions, headers.getlist)
            decode = request_decoder(
                upload.body(), headers.get(HEADER_LENGTH), state.limits, regions
            )
            queued: list[asyncio.Future] = []
            hangup: list[asyncio.Future] = []

            def on_queued(future: asyncio.Future) -> None:
                queued.append(future)
                on_disconnect = scope.get("extensions", {}).get(DISCONNECT_EXTENSION)
                if on_disconnect is not None:
                    on_disconnect(future.cancel)
                else:
                    waiting = asyncio.ensure_future(receive())
                    waiting.add_done_callback(functools.partial(_on_hangup, future=future))
                    hangup.append(waiting)

            # The version that answers is the one served now: while the body was read, a
            # newer version may have taken over (or the one picked, been unloaded).
            try:
                body, header_length = await core.infer(
                    server, name, version, decode, _encode, on_queued, scope["headers"]
                )
            except asyncio.CancelledError:
                if queued and queued[0].cancelled():
                    await _send(send, 499, b"", None, None)  # the client is gone
                    raise _Sent from None
                raise
            finally:
                for waiting in hangup:
                    waiting.cancel()
        finally:
            upload.release()  # inputs may view the body until the reply is made
        if header_length is None:
            await _send(send, 200, body, None, "application/json")
        else:
            extra = {"Inference-Header-Content-Length": str(header_length)}
            await _send(send, 200, body, extra, "application/octet-stream")


class _Sent(Exception):
    """The endpoint has answered (or has nobody to answer)."""


async def _send(
    send: Any, status: int, body: bytes, headers: Mapping[str, str] | None, media: str | None
) -> None:
    raw = [(b"content-length", b"%d" % len(body))]
    if media is not None:
        raw.append((b"content-type", media.encode()))
    for key, value in (headers or {}).items():
        raw.append((key.lower().encode("latin-1"), value.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def request_decoder(
    body: bytes, header_length: str | None, limits: HttpLimits, regions: Regions | None = None
) -> Callable[[ServedModel], InferRequest]:
    """``core.infer``'s ``decode`` for an HTTP request's body (JSON, then any binary
    tensor data; ``header_length``: the Inference-Header-Content-Length header;
    ``regions``: the system shared memory it may name)."""
    max_json = limits.max_json_bytes

    def decode(model: ServedModel) -> InferRequest:
        header, binary = codec.split_body(body, header_length)
        if len(header) > max_json:
            raise TooLarge(
                f"the request's JSON is {len(header)} bytes; the limit is {max_json} "
                "(send large tensors as binary data)"
            )
        return InferRequest.from_json(header, binary, model, regions)

    return decode


def _encode(
    name: str, model: ServedModel, request: InferRequest, outputs: dict
) -> tuple[bytes, int | None]:
    return codec.encode_response(name, model.version, request.id, outputs, request.outputs)


def _on_hangup(receive: asyncio.Future, future: asyncio.Future) -> None:
    if receive.cancelled() or receive.exception() is not None:
        return
    if receive.result().get("type") == "http.disconnect" and not future.done():
        future.cancel()


@_endpoint
async def _generate(request: Request) -> Response:
    on_disconnect = request.scope.get("extensions", {}).get(DISCONNECT_EXTENSION)
    return await generation.kserve_generate(request, _serving(request), on_disconnect)


@_endpoint
async def _generate_stream(request: Request) -> Response:
    return await generation.kserve_stream(request, _serving(request))


@_endpoint
async def _openai_completions(request: Request) -> Response:
    return await generation.openai_completions(request, _serving(request))


@_endpoint
async def _openai_chat(request: Request) -> Response:
    return await generation.openai_chat(request, _serving(request))


@_endpoint
async def _openai_embeddings(request: Request) -> Response:
    return await embeddings.openai_embeddings(request, _serving(request))


@_endpoint
async def _openai_models(request: Request) -> Response:
    return await generation.openai_models(request, _state(request).server)


@_endpoint
async def _openai_model(request: Request) -> Response:
    return await generation.openai_model(request, _state(request).server)


def _serving(request: Request) -> Backend:
    """The server, if it takes inference requests now (else ``NotServing``)."""
    return core.serving(_state(request).server)


_PREFIXES = ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")


def _generation_routes(restrictions: Restrictions) -> list[Route]:
    r = functools.partial(_restricted, restrictions)
    routes = [
        Route("/v1/completions", r("inference", _openai_completions), methods=["POST"]),
        Route("/v1/chat/completions", r("inference", _openai_chat), methods=["POST"]),
    ]
    for prefix in _PREFIXES:
        routes += [
            Route(prefix + "/generate", r("inference", _generate), methods=["POST"]),
            Route(prefix + "/generate_stream", r("inference", _generate_stream), methods=["POST"]),
        ]
    return routes


def _routes(restrictions: Restrictions, infer: InferEndpoint) -> list[Route]:
    r = functools.partial(_restricted, restrictions)
    routes = [
        Route("/v2", r("metadata", server_metadata)),
        Route("/v1/embeddings", r("inference", _openai_embeddings), methods=["POST"]),
        Route("/v2/health/live", r("health", live)),
        Route("/v2/health/ready", r("health", ready)),
        Route("/metrics", r("statistics", metrics)),
        Route("/v2/models/stats", r("statistics", all_stats)),  # before {model}: not a name
        Route("/v2/repository/index", r("model-repository", repository_index), methods=["POST"]),
        Route(
            "/v2/repository/models/{model}/load",
            r("model-repository", repository_load),
            methods=["POST"],
        ),
        Route(
            "/v2/repository/models/{model}/unload",
            r("model-repository", repository_unload),
            methods=["POST"],
        ),
    ]
    routes.append(Route("/v2/trace/setting", r("trace", trace_setting), methods=["GET", "POST"]))
    system, region = "/v2/systemsharedmemory", "/v2/systemsharedmemory/region/{region}"
    routes += [
        Route(system + "/status", r("shared-memory", shm_status)),
        Route(region + "/status", r("shared-memory", shm_status)),
        Route(region + "/register", r("shared-memory", shm_register), methods=["POST"]),
        Route(region + "/unregister", r("shared-memory", shm_unregister), methods=["POST"]),
        Route(system + "/unregister", r("shared-memory", shm_unregister), methods=["POST"]),
    ]
    cuda, cuda_region = "/v2/cudasharedmemory", "/v2/cudasharedmemory/region/{region}"
    for path, method in [
        (cuda + "/status", "GET"), (cuda_region + "/status", "GET"),
        (cuda_region + "/register", "POST"), (cuda_region + "/unregister", "POST"),
        (cuda + "/unregister", "POST"),
    ]:  # fmt: skip
        routes.append(Route(path, r("shared-memory", cuda_shm), methods=[method]))
    routes += _generation_routes(restrictions)
    routes.append(Route("/v1/models", r("metadata", _openai_models)))
    routes.append(Route("/v1/models/{model}", r("metadata", _openai_model)))
    for prefix in _PREFIXES:
        routes += [
            Route(prefix, r("metadata", model_metadata)),
            Route(prefix + "/ready", r("health", model_ready)),
            Route(prefix + "/config", r("metadata", model_config)),
            Route(prefix + "/stats", r("statistics", model_stats)),
            Route(prefix + "/infer", infer, methods=["POST"]),  # (checks its own key)
        ]
    return routes


__all__ = [
    "DISCONNECT_EXTENSION",
    "HEADER_LENGTH",
    "AppState",
    "BodiesFull",
    "InferEndpoint",
    "KServeApp",
    "BodyBudget",
    "create_app",
    "error_reply",
    "fast_route",
    "generation_app",
    "readiness",
    "request_decoder",
]
