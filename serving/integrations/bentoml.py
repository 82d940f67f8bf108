"""pxrt inside BentoML: ``pxrt_service``, a BentoML service whose API goes through pxrt's
batcher.

    # service.py
    from serving.integrations.bentoml import pxrt_service

    MLP = pxrt_service("models/mlp", max_delay_us=2000)  # an artifact; BatchingOptions

and ``bentoml serve service:MLP``. ``POST /predict`` takes the model's inputs as JSON
fields (``{"x": [[...], ...]}``, each input's rows in its dtype: BentoML's typed numpy
fields, so ``bentoml.SyncHTTPClient(url).predict(x=array)`` works) and answers
``{"y": [[...], ...]}``, one field per output. The API is async and not ``batchable``:
BentoML hands each request to it as it comes, and pxrt's batcher (made on the worker's
event loop at the first request) gathers the concurrent ones into the model's compiled
buckets. The service's constructor, which BentoML runs in each worker process, is
``pxrt.load`` (``load_options``). A value that is not a number of the input's dtype is
BentoML's own 400 (a validation error whose ``loc`` names the field); a wrong shape or a
missing input is a 400 (``InvalidArgument``) whose ``error`` names the input, and fails
alone; a full queue is a 503; a failed batch or a passed deadline a 500.

The service also mounts pxrt's own KServe v2 endpoint (``serving.http.create_app``) at
``/v2`` in BentoML's server (``v2=False``: not): ``POST /v2/models/{name}/infer`` with
JSON or binary tensors, the same model and batcher, without BentoML's per-request
validation and serialization, which is most of a small request's cost
(docs/integrations.md has the measurements). BentoML still runs the process: workers,
health, metrics, ``bentoml build`` and its deployment.
"""

from __future__ import annotations

import inspect
import types
from typing import Annotated, Any

import bentoml
import numpy as np
from bentoml.exceptions import InternalServerError, InvalidArgument, ServiceUnavailable
from bentoml.validators import DType

from pxrt.artifact import read_manifest

from ._on_loop import OnLoop
from ._on_loop import freeze_gc as _freeze_gc

__all__ = ["pxrt_service"]


def pxrt_service(
    path: str,
    *,
    name: str | None = None,
    route: str = "/predict",
    v2: bool = True,
    load_options: dict[str, Any] | None = None,
    service_config: dict[str, Any] | None = None,
    freeze_gc: bool = True,
    **batching: Any,
) -> Any:
    """A BentoML service (what ``@bentoml.service`` makes) serving the pxrt artifact at
    ``path`` as ``name`` (the artifact's by default) at ``route``, its requests batched
    by pxrt with ``batching`` (``BatchingOptions``' fields). ``service_config`` goes to
    ``bentoml.service`` (``workers``, ``traffic``...); ``v2``: mount pxrt's KServe v2
    endpoint at ``/v2``. Only the manifest is read here; the model loads when BentoML
    makes the service in its worker, which then freezes its garbage collector as ``pxrt
    serve`` does (``freeze_gc``; ``_on_loop.freeze_gc`` says why)."""
    manifest = read_manifest(path)
    served = name or manifest["name"]
    options = dict(load_options or {})
    fields = []
    for spec in manifest["inputs"]:  # (one typed field per input: BentoML's schema, its client)
        if not spec["name"].isidentifier():
            raise ValueError(
                f"input {spec['name']!r} of {path} is not a Python identifier, which "
                "BentoML's fields must be: re-export the model with another input name"
            )
        typed = Annotated[np.ndarray, DType(np.dtype(spec["dtype"]).name)]
        fields.append(
            inspect.Parameter(spec["name"], inspect.Parameter.KEYWORD_ONLY, annotation=typed)
        )

    # What the API and the v2 mount share in a worker process: one model, one batcher.
    shared = types.SimpleNamespace(model=None, batched=OnLoop(served, batching))

    class PxrtService:
        def __init__(self) -> None:
            import pxrt

            self.model = shared.model = pxrt.load(path, **options)
            if freeze_gc:
                _freeze_gc()
            self._batched = shared.batched

        async def predict(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
            return await self._batched.answer(
                self.model, inputs, InvalidArgument, ServiceUnavailable, InternalServerError
            )

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    PxrtService.predict.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [self_param, *fields], return_annotation=dict[str, np.ndarray]
    )
    PxrtService.predict = bentoml.api(route=route)(PxrtService.predict)  # type: ignore[method-assign]
    service = bentoml.service(name=served, **(service_config or {}))(PxrtService)
    if v2:
        service.mount_asgi_app(_V2(shared), path="/v2", name="pxrt-v2")
    return service


class _V2:
    """pxrt's KServe v2 app over the worker's model and batcher (``OnLoop.native_v2``).
    BentoML mounts it at ``/v2``: it is handed the whole path, as its routes are written."""

    def __init__(self, shared: types.SimpleNamespace) -> None:
        self.shared = shared

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # (a mount gets no lifespan; websockets: none here)
            return
        if self.shared.model is None:  # (BentoML routes only once the service is made)
            raise ServiceUnavailable("the model is not loaded yet")
        await self.shared.batched.native_v2(self.shared.model, scope, receive, send)
