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
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

import bentoml
import numpy as np
from bentoml.exceptions import InternalServerError, InvalidArgument, ServiceUnavailable
from bentoml.validators import DType

from pxrt.artifact import read_manifest

from ..errors import DeadlineExceeded, ExecutionFailed, Overloaded, ServerClosed
from ._on_loop import OnLoop

__all__ = ["pxrt_service"]


def pxrt_service(
    path: str,
    *,
    name: str | None = None,
    route: str = "/predict",
    load_options: dict[str, Any] | None = None,
    service_config: dict[str, Any] | None = None,
    **batching: Any,
) -> Any:
    """A BentoML service (what ``@bentoml.service`` makes) serving the pxrt artifact at
    ``path`` as ``name`` (the artifact's by default) at ``route``, its requests batched
    by pxrt with ``batching`` (``BatchingOptions``' fields). ``service_config`` goes to
    ``bentoml.service`` (``workers``, ``traffic``...). Only the manifest is read here;
    the model loads when BentoML makes the service in its worker."""
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

    class PxrtService:
        def __init__(self) -> None:
            import pxrt

            self.model = pxrt.load(path, **options)
            self._batched = OnLoop(served, batching)

        async def predict(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
            try:
                return await self._batched.infer(self.model, inputs)
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(str(exc)) from None
            except (Overloaded, ServerClosed) as exc:
                raise ServiceUnavailable(str(exc)) from None
            except (DeadlineExceeded, ExecutionFailed) as exc:
                raise InternalServerError(str(exc)) from None

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    PxrtService.predict.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [self_param, *fields], return_annotation=dict[str, np.ndarray]
    )
    PxrtService.predict = bentoml.api(route=route)(PxrtService.predict)  # type: ignore[method-assign]
    return bentoml.service(name=served, **(service_config or {}))(PxrtService)
