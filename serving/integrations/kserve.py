"""pxrt inside KServe's Python model server: ``PxrtModel``, a ``kserve.Model`` whose
``predict`` goes through pxrt's batcher.

    import kserve
    from serving.integrations.kserve import PxrtModel

    model = PxrtModel("mlp", "models/mlp")  # an artifact directory; batching options
    model.load()                            # every bucket compiled, params on the device
    kserve.ModelServer().start([model])

KServe decodes the v2 request (JSON or its binary tensor extension, REST or gRPC) into
an ``InferRequest``; ``predict`` hands its tensors to ``serving.Server.infer``, which
batches the concurrent requests (KServe's Python server runs each request on its own),
and answers an ``InferResponse`` (binary where the request asked for binary outputs or
came over gRPC). Errors take KServe's own shapes: a bad input (a wrong dtype or shape,
an unknown name: the message names it, as pxrt's does) is ``InvalidInput``, a 400, and
fails alone: the requests batched with it are answered; a full queue or a closed server
is ``ServerNotReady`` (503); a failed batch or a passed deadline ``InferenceError``.

With ``native_v2`` (the default), REST inference requests for the model
(``POST /v2/models/{name}[/versions/{v}]/infer``) are answered by pxrt's own v2
endpoint instead, the one ``pxrt serve`` runs: a middleware that ``load`` adds to
KServe's app (``kserve.model_server.app``, before the server starts) hands them to it,
over the same model and batcher; KServe's own middleware (its metrics, its logging)
still wraps them, and every other route (health, metadata, the model repository, gRPC)
is KServe's. It skips KServe's per-request ``InferRequest``/``InferResponse``
objects, most of a small request's cost. Same protocol, same error shape
(``{"error": ...}``, the status codes above). Off for a subclass that overrides
``preprocess`` or ``postprocess`` (the native path would skip them), and with
``native_v2=False``.
"""

from __future__ import annotations

from typing import Any

import kserve
import numpy as np
from kserve.errors import InferenceError, InvalidInput, ServerNotReady
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

from ..http.app import fast_route
from ..kserve import codec
from ._on_loop import OnLoop, freeze_gc, v2_tensors

__all__ = ["PxrtModel"]


class PxrtModel(kserve.Model):
    """A pxrt artifact served by KServe as ``name``: ``load`` compiles it (``pxrt.load``
    with ``load_options``), then freezes the process's garbage collector as ``pxrt
    serve`` does (``freeze_gc``; ``_on_loop.freeze_gc`` says why); its requests are
    batched by pxrt (``serving.Server``, created on KServe's event loop at the first
    request) with ``batching`` (``BatchingOptions``' fields: ``max_batch_size``,
    ``max_delay_us``, ``max_queue``...)."""

    def __init__(
        self,
        name: str,
        path: str,
        *,
        load_options: dict[str, Any] | None = None,
        native_v2: bool = True,
        freeze_gc: bool = True,
        **batching: Any,
    ) -> None:
        super().__init__(name)
        self.freeze_gc = freeze_gc
        self.path = path
        self.load_options = dict(load_options or {})
        self.model: Any = None
        self._batched = OnLoop(name, batching)
        hooks = ("preprocess", "postprocess")
        self.native_v2 = native_v2 and all(
            getattr(type(self), h) is getattr(kserve.Model, h) for h in hooks
        )

    def load(self) -> bool:
        import pxrt

        self.model = pxrt.load(self.path, **self.load_options)
        if self.freeze_gc:
            freeze_gc()
        if self.native_v2:
            _native_models[self.name] = self
            _install_native_path()
        self.ready = True
        return self.ready

    def get_input_types(self) -> list[dict]:
        """The inputs as KServe's metadata lists them (the batch dimension -1)."""
        return v2_tensors(self.model.inputs) if self.model is not None else []

    def get_output_types(self) -> list[dict]:
        return v2_tensors(self.model.outputs) if self.model is not None else []

    async def predict(
        self,
        payload: Any,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> InferResponse:
        if not isinstance(payload, InferRequest):
            raise InvalidInput(
                f"model {self.name!r} takes the v2 protocol (/v2/models/{self.name}/infer), "
                f"got a {type(payload).__name__}"
            )
        try:
            inputs = {tensor.name: tensor.as_numpy() for tensor in payload.inputs}
        except Exception as exc:  # noqa: BLE001 - KServe's decoding of a bad tensor
            raise InvalidInput(f"model {self.name!r}: {exc}") from None
        outputs = await self._batched.answer(
            self.model, inputs, InvalidInput, ServerNotReady, InferenceError
        )
        binary = payload.use_binary_outputs
        answer = []
        for name, array in outputs.items():
            array = np.asarray(array)
            tensor = InferOutput(name, list(array.shape), codec.datatype_of(array.dtype))
            tensor.set_data_from_numpy(array, binary_data=binary)
            answer.append(tensor)
        return InferResponse(
            response_id=payload.id or "",
            model_name=self.name,
            infer_outputs=answer,
            use_binary_outputs=binary,
        )

    def stop(self) -> None:
        if _native_models.get(self.name) is self:
            del _native_models[self.name]
        self._batched.close()
        super().stop()


# The models whose REST inference pxrt's own endpoint answers, by name (``load`` adds).
_native_models: dict[str, PxrtModel] = {}


def _install_native_path() -> None:
    """Add ``_NativeInference`` to KServe's app once (a middleware can only be added
    before the app starts: ``ModelServer.start`` comes after the models' ``load``)."""
    from kserve.model_server import app

    if not any(m.cls is _NativeInference for m in app.user_middleware):
        app.add_middleware(_NativeInference)


class _NativeInference:
    """An ASGI middleware on KServe's app: ``POST`` inference for a model in
    ``_native_models`` goes to pxrt's v2 app over that model's server; the rest on to
    KServe."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            found = fast_route("POST", scope["path"])
            model = _native_models.get(found[1]) if found is not None else None
            if model is not None and model.ready:
                await model._batched.native_v2(model.model, scope, receive, send)
                return
        await self.app(scope, receive, send)
