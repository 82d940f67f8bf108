"""KServe v2 / Open Inference Protocol over HTTP: a mountable Starlette app.

``create_app(server)`` serves the models of a ``serving.Server``: health, metadata,
Triton-style model config and statistics, inference with JSON or binary tensors, and
``/metrics`` in Prometheus text format. Errors come back as ``{"error": "..."}``: 400 for
a malformed request or a validation error, 404 for an unknown model, version or path,
405 for a wrong method, 413 for a body (or its JSON part) over the limit (refused before
it is read), 429 with ``Retry-After`` when the queue is full, 503 while loading or
draining or when the app already holds its budget of request bodies, 504 when the
request's deadline passed in the queue, 500 when its batch failed or anything
unexpected happened (logged in one line). A client that hangs up takes its request out
of the queue if it was not dispatched yet. Limits on connections, header sizes and slow
clients are the HTTP protocol's (``serving.protocol``), which ``pxrt serve`` uses.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from . import kserve
from .errors import DeadlineExceeded, ExecutionFailed, Overloaded, ServerClosed, UnknownModel
from .protocol import DISCONNECT_EXTENSION
from .server import Server

log = logging.getLogger("pxrt.http")

HEADER_LENGTH = "inference-header-content-length"
DEFAULT_MAX_BODY_BYTES = 64 << 20
# The JSON part of a request: parsing it holds the GIL (so the loop) for ~10 ms a MB.
# Large tensors go as binary data, which decodes in constant time.
DEFAULT_MAX_JSON_BYTES = 16 << 20
DEFAULT_MAX_PENDING_BODY_BYTES = 512 << 20


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


def _json(doc: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(
        orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY),
        status,
        headers,
        media_type="application/json",
    )


def _error(status: int, message: str, headers: dict | None = None) -> Response:
    return _json({"error": message}, status, headers)


class BodyBudget:
    """Bytes of request bodies the app holds at once, over all requests: uploads that
    would go over it are answered 503 (retry later) instead of growing memory."""

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


class State:
    """What the app knows beyond the Server: readiness and draining."""

    def __init__(self) -> None:
        self.ready = False  # every model loaded, compiled and warmed
        self.draining = False  # shutting down: refuse new inference


def create_app(
    server: Server,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
    max_pending_body_bytes: int = DEFAULT_MAX_PENDING_BODY_BYTES,
    state: State | None = None,
    lifespan: Any = None,
    repository: Any = None,
) -> Starlette:
    """A Starlette app speaking KServe v2 for ``server``'s models.

    Mount it in your own ASGI app, or run it with uvicorn (``pxrt serve`` does). The
    app is ready once ``state.ready`` is set; with no ``state`` given, it is ready as
    soon as it is created (its models are loaded by then).
    """
    if state is None:
        state = State()
        state.ready = True
    budget = BodyBudget(max_pending_body_bytes)

    def model_of(request: Request) -> tuple[str, Any, Any]:
        name = request.path_params["model"]
        try:
            batcher = server.batcher(name, request.path_params.get("version"))
        except UnknownModel as exc:
            raise _HTTPError(404, str(exc)) from None
        return name, batcher.model, batcher

    def handled(fn):
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except _HTTPError as exc:
                return _error(exc.status, str(exc), exc.headers)
            except Exception as exc:  # noqa: BLE001 - a JSON 500, one log line, connection kept
                log.error(
                    "pxrt: %s %s failed: %s: %.200s",
                    request.method,
                    request.url.path,
                    type(exc).__name__,
                    exc,
                )
                return _error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")

        return endpoint

    def not_serving() -> str | None:
        """Why inference is refused now, or None."""
        if state.draining:
            return "the server is draining; not accepting inference requests"
        if not state.ready:
            return "the server is loading; not accepting inference requests"
        return None

    async def server_metadata(request: Request) -> Response:
        return _json(kserve.server_metadata())

    async def live(request: Request) -> Response:
        return _json({"live": True})

    async def ready(request: Request) -> Response:
        why = not_serving()
        if why:
            return _json({"ready": False, "error": why}, 503)
        return _json({"ready": True})

    async def model_ready(request: Request) -> Response:
        name, _, _ = model_of(request)
        why = not_serving()
        if why:
            return _json({"name": name, "ready": False, "error": why}, 503)
        return _json({"name": name, "ready": True})

    async def model_metadata(request: Request) -> Response:
        name, model, _ = model_of(request)
        return _json(kserve.model_metadata(name, model, server.versions(name)))

    async def model_config(request: Request) -> Response:
        name, model, batcher = model_of(request)
        return _json(kserve.model_config(name, model, batcher))

    def stats_of(name: str, model: Any) -> dict:
        return kserve.model_stats(name, model, server.metrics_snapshot()[name])

    async def model_stats(request: Request) -> Response:
        name, model, _ = model_of(request)
        return _json({"model_stats": [stats_of(name, model)]})

    async def all_stats(request: Request) -> Response:
        return _json(
            {"model_stats": [stats_of(name, model) for name, model in server.models.items()]}
        )

    def repo() -> Any:
        if repository is None:
            raise _HTTPError(
                400, "no model repository: start pxrt serve with --model-repository DIR"
            )
        return repository

    async def repository_index(request: Request) -> Response:
        rows = repo().index()
        body = await request.body()
        if body:
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise _HTTPError(400, f"malformed JSON in the request: {exc}") from None
            if isinstance(doc, dict) and doc.get("ready") is True:
                rows = [r for r in rows if r["state"] == "READY"]
        return _json(rows)

    async def repository_load(request: Request) -> Response:
        try:
            await repo().load(request.path_params["model"])
        except ValueError as exc:  # RepositoryError: unknown model, mode none, failed
            raise _HTTPError(400, str(exc)) from None
        return _json({})

    async def repository_unload(request: Request) -> Response:
        try:
            await repo().unload(request.path_params["model"])
        except ValueError as exc:
            raise _HTTPError(400, str(exc)) from None
        return _json({})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def read_body(request: Request, held: list[int]) -> bytes:
        """The whole body, within the per-request limit and the app's budget of bytes
        held over all requests; ``held[0]`` is what this request holds of the budget
        (the caller gives it back)."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise _HTTPError(
                413, f"the request body has {length} bytes; the limit is {max_body_bytes}"
            )
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise _HTTPError(
                    413, f"the request body is over the limit of {max_body_bytes} bytes"
                )
            if not budget.take(len(chunk)):
                raise _HTTPError(
                    503,
                    f"the server holds the most request bodies it may ({budget.limit} bytes); "
                    "retry later",
                    {"Retry-After": "1"},
                )
            held[0] += len(chunk)
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def infer(request: Request) -> Response:
        why = not_serving()
        if why:
            raise _HTTPError(503, why)
        _, _, batcher = model_of(request)  # an unknown model is a 404 before its body
        held = [0]
        try:
            return await infer_body(request, held)
        except _HTTPError:
            raise
        except Exception:
            batcher.count("failed")  # unexpected: handled() answers a JSON 500
            raise
        finally:
            budget.give(held[0])  # inputs may view the body until the reply is made

    async def infer_body(request: Request, held: list[int]) -> Response:
        body = await read_body(request, held)
        # The version that answers is the one served now: while the body was read, a
        # newer version may have taken over (or the one picked, been unloaded).
        name, model, batcher = model_of(request)
        try:
            header, binary = kserve.split_body(body, request.headers.get(HEADER_LENGTH))
            if len(header) > max_json_bytes:
                raise _HTTPError(
                    413,
                    f"the request's JSON is {len(header)} bytes; the limit is {max_json_bytes} "
                    "(send large tensors as binary data)",
                )
            doc = kserve.parse_json(header)
            rid = kserve.request_id(doc)
            inputs = kserve.decode_inputs(doc, binary, model.inputs)
            selected = kserve.requested_outputs(doc, list(model.outputs))
            timeout_s = _timeout(doc)
        except kserve.ProtocolError as exc:
            batcher.count("invalid")
            raise _HTTPError(400, str(exc)) from None
        queued = server.infer(name, inputs, timeout_s=timeout_s, version=model.version)
        future = getattr(queued, "future", None)
        # A client that hangs up takes its request out of the queue if it is not
        # dispatched yet. pxrt serve's protocol reports that through a scope extension;
        # under another server, a pending receive() per request does.
        hangup = None
        if future is not None:
            on_disconnect = request.scope.get("extensions", {}).get(DISCONNECT_EXTENSION)
            if on_disconnect is not None:
                on_disconnect(future.cancel)
            else:
                hangup = asyncio.ensure_future(request.receive())
                hangup.add_done_callback(lambda t: _on_hangup(t, future))
        try:
            outputs = await queued
        except asyncio.CancelledError:
            if future is not None and future.cancelled():
                return Response(status_code=499)  # the client is gone; nobody reads it
            raise
        except (TypeError, ValueError) as exc:
            raise _HTTPError(400, str(exc)) from None
        except Overloaded as exc:
            raise _HTTPError(
                429, str(exc), {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
            ) from None
        except DeadlineExceeded as exc:
            raise _HTTPError(504, str(exc)) from None
        except ServerClosed as exc:
            raise _HTTPError(503, str(exc)) from None
        except ExecutionFailed as exc:
            raise _HTTPError(500, str(exc)) from None
        finally:
            if hangup is not None:
                hangup.cancel()
        return infer_response(*kserve.encode_response(name, model.version, rid, outputs, selected))

    routes = [
        Route("/v2", handled(server_metadata)),
        Route("/v2/health/live", handled(live)),
        Route("/v2/health/ready", handled(ready)),
        Route("/metrics", handled(metrics)),
        Route("/v2/models/stats", handled(all_stats)),  # before {model}: not a model's name
        Route("/v2/repository/index", handled(repository_index), methods=["POST"]),
        Route("/v2/repository/models/{model}/load", handled(repository_load), methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", handled(repository_unload), methods=["POST"]),
    ]
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            Route(prefix, handled(model_metadata)),
            Route(prefix + "/ready", handled(model_ready)),
            Route(prefix + "/config", handled(model_config)),
            Route(prefix + "/stats", handled(model_stats)),
            Route(prefix + "/infer", handled(infer), methods=["POST"]),
        ]

    async def routing_error(request: Request, exc: HTTPException) -> Response:
        # Starlette's own 404/405 (no route, wrong method), as every other error: JSON.
        if exc.status_code == 404:
            message = f"no endpoint {request.url.path!r}; the API is KServe v2 under /v2"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        else:
            message = str(exc.detail)
        return _error(exc.status_code, message, exc.headers)

    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: routing_error}
    )
    app.state.pxrt = state
    return app


def _on_hangup(receive: asyncio.Future, future: asyncio.Future) -> None:
    if receive.cancelled() or receive.exception() is not None:
        return
    if receive.result().get("type") == "http.disconnect" and not future.done():
        future.cancel()


def infer_response(body: bytes, header_length: int | None) -> Response:
    """The HTTP response for an encoded inference result (``kserve.encode_response``)."""
    if header_length is None:
        return Response(body, media_type="application/json")
    return Response(
        body,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(header_length)},
    )


def _timeout(doc: dict) -> float | None:
    params = doc.get("parameters")
    if not isinstance(params, dict) or params.get("timeout") is None:
        return None
    timeout = params["timeout"]
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise kserve.ProtocolError("parameters.timeout must be a positive number of microseconds")
    return timeout * 1e-6
