"""What every integration shares: pxrt's batcher for one model on the event loop the
framework runs its requests on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ..errors import DeadlineExceeded, ExecutionFailed, Overloaded, ServerClosed


class OnLoop:
    """``model`` served by a ``serving.Server`` as ``name`` with ``batching``
    (``BatchingOptions``' fields), made on the running loop at the first request (a
    framework starts its loop after the model is loaded, and may run it in a process of
    its own) and made again if a call comes from another loop."""

    def __init__(self, name: str, batching: dict[str, Any]) -> None:
        self.name = name
        self.batching = batching
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._app_of: Any = None  # (the server ``native_v2``'s app serves)
        self._app: Any = None

    def server(self, model: Any) -> Any:
        """The ``serving.Server`` serving ``model`` on the running loop."""
        loop = asyncio.get_running_loop()
        if self._server is None or self._loop is not loop:
            from serving import Server

            server = Server()
            server.add_model(self.name, model, **self.batching)
            self._server, self._loop = server, loop
        return self._server

    def infer(self, model: Any, inputs: dict[str, Any]) -> Awaitable[dict]:
        """``serving.Server.infer`` of ``inputs``, batched with the other callers'."""
        return self.server(model).infer(self.name, inputs)

    async def answer(
        self,
        model: Any,
        inputs: dict[str, Any],
        bad_input: Callable[[str], BaseException],
        unavailable: Callable[[str], BaseException],
        failed: Callable[[str], BaseException],
    ) -> dict:
        """``infer``, pxrt's errors raised as the framework's (each made from the
        message): a bad request (TypeError/ValueError naming the input), a full queue or
        a closed server, a failed batch or a passed deadline."""
        try:
            return await self.infer(model, inputs)
        except (TypeError, ValueError) as exc:
            raise bad_input(str(exc)) from None
        except (Overloaded, ServerClosed) as exc:
            raise unavailable(str(exc)) from None
        except (DeadlineExceeded, ExecutionFailed) as exc:
            raise failed(str(exc)) from None

    async def native_v2(
        self, model: Any, scope: Any, receive: Any, send: Any, path: str | None = None
    ) -> None:
        """Answer an ASGI request with pxrt's own KServe v2 app (``serving.http.create_app``)
        over ``server(model)`` (made again with it): its inference path decodes and
        encodes the request itself, without the framework's per-request objects. The app
        is handed the request's whole path (``path`` instead, where given) and no root
        path, as its routes are written; the scope is copied only to change those."""
        server = self.server(model)
        if self._app_of is not server:
            from ..http import create_app

            self._app_of, self._app = server, create_app(server)
        if path is not None or scope.get("root_path"):
            scope = {**scope, "root_path": "", "path": path or scope["path"]}
        await self._app(scope, receive, send)

    async def aclose(self) -> None:
        """Close the server, awaited where its loop is the running one (else as
        ``close``)."""
        server, loop = self._server, self._loop
        if server is not None and loop is asyncio.get_running_loop():
            self._server = self._app_of = self._app = None
            await server.close()
        else:
            self.close()

    def close(self) -> None:
        """Close the server from any thread (on its loop, while that runs)."""
        server, loop = self._server, self._loop
        self._server = self._app_of = self._app = None
        if server is not None and loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(server.close(), loop)


def freeze_gc() -> None:
    """What ``pxrt serve`` does once its models are loaded, in the framework's process:
    collect, then freeze what is left (``gc.freeze``), so that the collector's full
    passes no longer walk jax's and the framework's many long-lived objects while
    requests wait: those passes were the tail of the latency under load (the encoder
    behind KServe at 64 callers: p99 148 ms, 62 ms frozen). Every integration calls it
    after ``pxrt.load`` unless told not to (``freeze_gc=False``)."""
    from ..serve import refreeze_gc

    refreeze_gc()


def v2_tensors(specs: Any) -> list[dict]:
    """``name -> spec`` (a shape without the batch, named dimensions -1, and a dtype) as
    the v2 metadata's tensors."""
    from ..kserve import codec

    return [
        {
            "name": name,
            "datatype": codec.datatype_of(np.dtype(spec.dtype)),
            "shape": [-1, *(d if isinstance(d, int) else -1 for d in spec.shape)],
        }
        for name, spec in specs.items()
    ]
