"""pxrt inside Lightning's LitServe: ``PxrtLitAPI``, a ``litserve.LitAPI`` whose
``predict`` goes through pxrt's batcher.

    import litserve as ls
    from serving.integrations.litserve import PxrtLitAPI

    if __name__ == "__main__":  # (LitServe spawns its workers: they import this file)
        api = PxrtLitAPI("models/mlp", max_delay_us=2000)  # an artifact; BatchingOptions
        ls.LitServer(api, accelerator="cpu").run(port=8000)

``POST /predict`` with ``{"inputs": {"x": [[...], ...]}}`` (each input's rows, in the
model's dtype) answers ``{"outputs": {"y": [[...], ...]}}``. The API is async
(``enable_async``): LitServe's worker runs the requests it takes concurrently, and
pxrt's batcher (made on the worker's event loop at the first request) gathers them into
the model's compiled buckets; LitServe's own batching (``max_batch_size``) stays off.
``setup`` loads the artifact in LitServe's worker process (``pxrt.load``, with
``load_options``). A bad request (an unknown input, a wrong shape, values that are not
numbers of the input's dtype) is a 400 naming the input, and fails alone; a full queue
is a 503, a failed batch or a passed deadline a 500.
"""

from __future__ import annotations

from typing import Any

import litserve
import numpy as np
from fastapi import HTTPException

from ._on_loop import OnLoop, freeze_gc

__all__ = ["PxrtLitAPI"]


class PxrtLitAPI(litserve.LitAPI):
    """The pxrt artifact at ``path`` served by LitServe (at ``api_path``), its requests
    batched by pxrt with ``batching`` (``BatchingOptions``' fields); ``setup`` freezes
    the worker's garbage collector after loading, as ``pxrt serve`` does (``freeze_gc``;
    ``_on_loop.freeze_gc`` says why)."""

    _batched: OnLoop  # (made by ``setup``, in LitServe's worker, with the model)

    def __init__(
        self,
        path: str,
        *,
        api_path: str = "/predict",
        load_options: dict[str, Any] | None = None,
        freeze_gc: bool = True,
        **batching: Any,
    ) -> None:
        super().__init__(api_path=api_path, enable_async=True)
        self.freeze_gc = freeze_gc
        self.path = path
        self.load_options = dict(load_options or {})
        self.batching = batching
        self.model: Any = None

    def setup(self, device: Any) -> None:
        import pxrt

        self.model = pxrt.load(self.path, **self.load_options)
        if self.freeze_gc:
            freeze_gc()
        self._batched = OnLoop(self.model.name, self.batching)

    async def decode_request(self, request, **kwargs: Any) -> dict[str, np.ndarray]:
        """``{"inputs": {name: rows}}`` as arrays of the inputs' dtypes (a 400 naming
        the input whose values are not numbers of its dtype)."""
        inputs = request.get("inputs") if isinstance(request, dict) else None
        if not isinstance(inputs, dict):
            raise HTTPException(400, 'the body is {"inputs": {name: rows, ...}}')
        specs = self.model.inputs
        out = {}
        for name, value in inputs.items():
            spec = specs.get(name)
            if spec is None:  # (pxrt's batcher names it with the known ones)
                out[name] = np.asarray(value)
                continue
            try:
                out[name] = np.asarray(value, dtype=spec.dtype)
            except (TypeError, ValueError) as exc:
                raise HTTPException(
                    400, f"input {name!r}: not rows of {np.dtype(spec.dtype).name} ({exc})"
                ) from None
        return out

    async def predict(self, inputs: dict[str, np.ndarray], **kwargs: Any) -> dict:
        return await self._batched.answer(
            self.model,
            inputs,
            lambda m: HTTPException(400, m),
            lambda m: HTTPException(503, m),
            lambda m: HTTPException(500, m),
        )

    async def encode_response(self, outputs: dict, **kwargs: Any) -> dict:
        return {"outputs": {name: np.asarray(v).tolist() for name, v in outputs.items()}}
