"""pxrt inside Seldon's MLServer: ``PxrtRuntime``, a custom runtime (``mlserver.MLModel``)
whose ``predict`` goes through pxrt's batcher.

A model folder holds the artifact (or points at it) and a ``model-settings.json``::

    {
      "name": "mlp",
      "implementation": "serving.integrations.mlserver.PxrtRuntime",
      "parameters": {"uri": "./mlp", "extra": {"batching": {"max_delay_us": 2000}}}
    }

then ``mlserver start FOLDER`` (with ``"parallel_workers": 0`` in the folder's
``settings.json``: pxrt batches on MLServer's own loop, and an inference worker process
would cost a crossing per request). ``uri`` is the artifact directory (relative to the
settings file); ``extra`` may hold ``load_options`` (for ``pxrt.load``), ``batching``
(``BatchingOptions``' fields) and ``freeze_gc`` (default true: after loading, the
process's garbage collector is frozen as ``pxrt serve`` does; ``_on_loop.freeze_gc``).
MLServer decodes the v2 request (REST JSON or gRPC); ``predict`` hands its tensors, as
numpy arrays of their v2 datatypes, to ``serving.Server.infer``, which batches the
concurrent requests (MLServer's own adaptive batching, ``max_batch_size``, stays off:
leave it unset), and answers the outputs as v2 tensors. The metadata endpoint lists the
artifact's inputs and outputs unless the settings name them. Errors take MLServer's
shape (``{"error": ...}``): a bad input (a wrong datatype or shape, an unknown name: the
message names it) is a 400 and fails alone: the requests batched with it are answered; a
full queue is a 503; a failed batch or a passed deadline a 500.

With ``"native_v2"`` (in ``extra``; true by default), REST inference requests for the
model (``POST /v2/models/{name}/infer``, and its own version's) are answered by pxrt's
own v2 endpoint instead, the one ``pxrt serve`` runs: ``load`` puts routes for them
ahead of MLServer's in its REST app, over the same model and batcher. Same protocol
(JSON tensors, and the binary extension, which MLServer's REST does not read), same
error shape; it skips MLServer's per-request pydantic objects and codecs, most of a
small request's cost. MLServer's middleware (its metrics, gzip, CORS) still wraps
them; its per-model inference metrics and its gRPC are its own (gRPC goes through
``predict``). It needs the model in the process that serves REST: with
``parallel_workers`` above 0 requests go through ``predict``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse, MetadataTensor
from mlserver.utils import get_model_uri
from starlette.routing import Route

from ._on_loop import OnLoop, freeze_gc, v2_tensors

__all__ = ["PxrtRuntime"]


class PxrtRuntime(MLModel):
    """A pxrt artifact served by MLServer (see the module's docstring for the settings)."""

    async def load(self) -> bool:
        import pxrt

        settings = self.settings
        extra = (settings.parameters.extra if settings.parameters else None) or {}
        path = await get_model_uri(settings)
        self.model: Any = pxrt.load(path, **extra.get("load_options", {}))
        self._batched = OnLoop(self.name, dict(extra.get("batching", {})))
        if not settings.inputs:  # (the metadata endpoint's, unless the settings list them)
            settings.inputs = [MetadataTensor(**t) for t in v2_tensors(self.model.inputs)]
        if not settings.outputs:
            settings.outputs = [MetadataTensor(**t) for t in v2_tensors(self.model.outputs)]
        self._native: list[Route] = []
        if extra.get("native_v2", True):
            self._native = _install_native_routes(self)
        self._freeze = bool(extra.get("freeze_gc", True))
        if self._freeze:
            freeze_gc()
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {}
        for tensor in payload.inputs:
            try:
                inputs[tensor.name] = NumpyCodec.decode_input(tensor)
            except (TypeError, ValueError) as exc:
                raise MLServerError(f"input {tensor.name!r}: {exc}", 400) from None
        outputs = await self._batched.answer(
            self.model,
            inputs,
            lambda m: MLServerError(m, 400),
            lambda m: MLServerError(m, 503),
            lambda m: MLServerError(m, 500),
        )
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            id=payload.id,
            outputs=[NumpyCodec.encode_output(k, np.asarray(v)) for k, v in outputs.items()],
        )

    async def unload(self) -> bool:
        app = _rest_app()
        for route in self._native:
            if app is not None and route in app.router.routes:
                app.router.routes.remove(route)
        self._native = []
        await self._batched.aclose()  # (its requests answered, then the model let go)
        self.model = None
        if self._freeze:  # (the model's cycles, frozen at its load, collected)
            freeze_gc()
        return True


def _rest_app() -> Any:
    """The FastAPI app of MLServer's REST server in this process, or None (an inference
    worker process has none). MLServer hands a runtime no reference to its server, so
    it is found among the process's objects: the one ``RESTServer`` ``mlserver start``
    made (MLServer 1.7 keeps its app as ``_app``), frozen objects included."""
    import gc
    import multiprocessing

    from mlserver.rest.server import RESTServer

    if multiprocessing.parent_process() is not None:  # (a worker: it may hold a copy)
        return None
    frozen = gc.get_freeze_count()  # (an earlier load froze it: the search skips those)
    if frozen:
        gc.unfreeze()
    servers = [o for o in gc.get_referrers(RESTServer) if isinstance(o, RESTServer)]
    if frozen:
        gc.freeze()
    return getattr(servers[0], "_app", None) if len(servers) == 1 else None


def _install_native_routes(runtime: PxrtRuntime) -> list[Route]:
    """Put routes for the runtime's REST inference
    (``POST /v2/models/{name}[/versions/{v}]/infer``) ahead of MLServer's own, each
    handing the request to pxrt's own v2 app (``OnLoop.native_v2``) over the runtime's
    model and batcher. Routes, not a middleware: MLServer's app has started (and built
    its middleware) before models load, while its routes are matched in list order at
    each request. MLServer's middleware (metrics, gzip, CORS) still wraps them."""
    app = _rest_app()
    if app is None:
        return []
    base = f"/v2/models/{runtime.name}"
    routes = [Route(f"{base}/infer", _NativeInference(runtime), methods=["POST"])]
    if runtime.version:  # (the model's own version only: pxrt serves it unversioned)
        to_base = _NativeInference(runtime, f"{base}/infer")
        routes.append(Route(f"{base}/versions/{runtime.version}/infer", to_base, methods=["POST"]))
    app.router.routes[:0] = routes
    return routes


class _NativeInference:
    """An ASGI endpoint: pxrt's v2 app over ``runtime``'s model and batcher, handed the
    request's whole path (as pxrt's routes are written), or ``path`` instead."""

    def __init__(self, runtime: PxrtRuntime, path: str | None = None) -> None:
        self.runtime = runtime
        self.path = path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        runtime = self.runtime
        await runtime._batched.native_v2(runtime.model, scope, receive, send, self.path)
