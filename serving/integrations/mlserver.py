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
settings file); ``extra`` may hold ``load_options`` (for ``pxrt.load``) and ``batching``
(``BatchingOptions``' fields). MLServer decodes the v2 request (REST JSON or gRPC);
``predict`` hands its tensors, as numpy arrays of their v2 datatypes, to
``serving.Server.infer``, which batches the concurrent requests (MLServer's own adaptive
batching, ``max_batch_size``, stays off: leave it unset), and answers the outputs as v2
tensors. The metadata endpoint lists the artifact's inputs and outputs unless the
settings name them. Errors take MLServer's shape (``{"error": ...}``): a bad input (a
wrong datatype or shape, an unknown name: the message names it) is a 400 and fails
alone: the requests batched with it are answered; a full queue is a 503; a failed batch
or a passed deadline a 500.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.errors import MLServerError
from mlserver.types import InferenceRequest, InferenceResponse, MetadataTensor
from mlserver.utils import get_model_uri

from ._on_loop import OnLoop, v2_tensors

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
        self._batched.close()
        return True
