"""pxrt replicas on Ray Serve: each replica loads the artifact once (every bucket compiled
before it takes traffic) and runs a ``serving.Server`` inside it, so requests are batched
where the device is. Needs the ``ray`` extra (``pip install 'pxrt[ray]'``).

    from ray import serve
    from serving.ray import PxrtDeployment

    app = PxrtDeployment.options(num_replicas=2, ray_actor_options={"num_cpus": 1}).bind(
        "models/mlp", max_batch_size=64)
    handle = serve.run(app)       # KServe v2 over Ray's HTTP proxy, at the route prefix
    out = await handle.infer.remote({"x": x})        # or .result() outside a loop

``pxrt_app(path, num_replicas=2, ...)`` builds the same application with Ray's
deployment options (``num_replicas``, ``autoscaling_config``, ``ray_actor_options``)
beside pxrt's (``Server.add_model``'s, and ``load_options`` for ``pxrt.load``); it sizes
``max_ongoing_requests`` from the batcher's queue so that Ray hands a replica as many
requests as pxrt may queue, and pxrt's queue policy (``Overloaded``, deadlines) decides
the rest. ``pxrt serve --ray PATH --replicas N`` runs it from a shell.

Errors reach callers as from ``pxrt serve``: over HTTP the same status codes (400 for a
bad request, 429 with Retry-After when the queue is full, 504 past a deadline); through
a handle the same exception types (``ValueError``, ``Overloaded``, ``DeadlineExceeded``...;
Ray wraps them in a ``RayTaskError`` that is also an instance of the original type).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Mapping
from typing import Any

try:
    from ray import serve
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise ImportError(f"serving.ray needs Ray Serve ({exc}): pip install 'pxrt[ray]'") from exc

from .engine.server import Server
from .options import BatchingOptions

log = logging.getLogger("pxrt.ray")


@serve.deployment(
    # Requests Ray may hand one replica at once by default: as many as the batcher's
    # default queue holds, of one row each.
    max_ongoing_requests=BatchingOptions().max_queue,
    health_check_period_s=5,
    health_check_timeout_s=30,
    ray_actor_options={"num_cpus": 1},
)
@serve.ingress()
class PxrtDeployment:
    """One replica: a pxrt model loaded (compiled, params on device) and served by a
    ``serving.Server`` on the replica's event loop.

    Args:
      path: the artifact directory (a path every replica's node can read; the
        persistent compilation cache beside it is shared).
      name: the model's name in the KServe v2 API (default: the manifest's).
      load_options: keyword arguments of ``pxrt.load`` (``buckets``, ``devices``...).
      options, changes: the model's ``BatchingOptions`` (``max_batch_size``,
        ``max_delay_us``, ``max_queue``, ``default_timeout_s``, ``max_inflight``...),
        as ``Server.add_model`` takes them.
    """

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits async constructors
        self,
        path: str,
        *,
        name: str | None = None,
        load_options: Mapping[str, Any] | None = None,
        options: BatchingOptions | None = None,
        **changes: Any,
    ) -> None:
        import pxrt

        self.server = Server()
        # Compiling every bucket takes a while: on a worker thread, so the replica's
        # loop keeps answering Ray; the replica takes traffic only once this returns.
        model = await asyncio.to_thread(pxrt.load, path, **dict(load_options or {}))
        self.name = name or model.name
        log.info("pxrt: replica of %r %s", self.name, model.load_summary())
        self.server.add_model(self.name, model, options, **changes)
        # One small request through the whole path: the replica is warm when Ray
        # first routes to it.
        smallest = {dim: lengths[0] for dim, lengths in model.dim_buckets.items()}
        await self.server.infer(self.name, pxrt.example_inputs(model.inputs, 1, lengths=smallest))

    def __serve_build_asgi_app__(self) -> Any:
        from .http.app import create_app

        return create_app(self.server)

    async def infer(
        self,
        inputs: Mapping[str, Any],
        *,
        model: str | None = None,
        timeout_s: float | None = None,
        version: str | None = None,
    ) -> dict:
        """``Server.infer`` on this replica: input name -> numpy array (n >= 1 rows) in,
        output name -> numpy array out."""
        return await self.server.infer(
            model or self.name, inputs, timeout_s=timeout_s, version=version
        )

    async def infer_many(
        self,
        requests: list[Mapping[str, Any]],
        timeouts_s: list[float | None] | None = None,
        *,
        model: str | None = None,
    ) -> list[Any]:
        """Many requests in one Ray call (``PxrtHandle`` sends these): each is queued on
        its own, so the list holds each one's outputs or its own exception."""
        name = model or self.name
        timeouts = timeouts_s or [None] * len(requests)
        queued = [self.server.infer(name, r, timeout_s=t) for r, t in zip(requests, timeouts)]
        return await asyncio.gather(*queued, return_exceptions=True)

    def metadata(self) -> dict:
        """The model's KServe v2 metadata document."""
        from .kserve import documents

        return documents.model_metadata(self.name, self.server.model(self.name))

    def metrics(self) -> dict:
        """This replica's metrics snapshot (``Server.metrics_snapshot``), and its pid."""
        return {"pid": os.getpid(), "models": self.server.metrics_snapshot()}

    def check_health(self) -> None:
        """Ray's health check: the model is served and its pipeline alive."""
        self.server.check_health(self.name)

    def reconfigure(self, config: Mapping[str, Any]) -> None:
        """Ray Serve's in-place update of every replica (the deployment's
        ``user_config``): ``{"draining": True}`` makes the replica refuse new requests
        (503 / ``ServerClosed``-like errors) while it answers those it accepted."""
        if config.get("draining"):
            self.server.drain()

    async def __del__(self) -> None:
        await self.server.close()


class PxrtHandle:
    """The calling side of a ``PxrtDeployment``: ``await h.infer({"x": x})`` from many
    tasks of one event loop, sent to the replicas in few Ray calls.

    Ray spends about the same on each call whatever it carries (routing, the actor
    call, serialization: on this project's 2-core machine that caps a plain handle at a
    few hundred calls per second), so requests issued while ``max_inflight`` calls are
    out wait and go together in the next call (up to ``max_requests``), as pxrt's
    batcher does on the device: nothing waits while a call slot is free. Each request
    is validated and answered on its own: a bad one raises its own error
    (``ValueError``, ``Overloaded``...) and the others in its call are unaffected.

    Args:
      handle: the deployment's handle (``serve.run(app)`` or ``serve.get_app_handle``).
      max_inflight: Ray calls out at once (spread over the replicas by Ray's router).
    """

    def __init__(
        self,
        handle: Any,
        *,
        model: str | None = None,
        max_inflight: int = 4,
        max_requests: int = 512,
    ) -> None:
        if max_inflight < 1 or max_requests < 1:
            raise ValueError("max_inflight and max_requests must be >= 1")
        self.handle = handle
        self.model = model
        self.max_inflight = max_inflight
        self.max_requests = max_requests
        self._pending: list[tuple[Mapping[str, Any], float | None, asyncio.Future]] = []
        self._inflight = 0
        self._tasks: set[asyncio.Task] = set()

    async def infer(self, inputs: Mapping[str, Any], *, timeout_s: float | None = None) -> dict:
        """Output name -> numpy array for ``inputs`` (input name -> n >= 1 rows)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((inputs, timeout_s, future))
        self._send_what_fits()
        return await future

    def _send_what_fits(self) -> None:
        while self._pending and self._inflight < self.max_inflight:
            group = self._pending[: self.max_requests]
            del self._pending[: self.max_requests]
            self._inflight += 1
            task = asyncio.ensure_future(self._call(group))
            self._tasks.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._tasks.discard)

    async def _call(self, group: list) -> None:
        try:
            live = [g for g in group if not g[2].done()]  # callers that gave up are dropped
            if not live:
                return
            try:
                results = await self.handle.infer_many.remote(
                    [g[0] for g in live], [g[1] for g in live], model=self.model
                )
            except Exception as exc:  # noqa: BLE001 - the call failed: each caller hears it
                results = [exc] * len(live)
            for (_, _, future), result in zip(live, results):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
        finally:
            self._inflight -= 1
            self._send_what_fits()


def pxrt_app(
    path: str,
    *,
    num_replicas: int | str | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    name: str | None = None,
    load_options: Mapping[str, Any] | None = None,
    options: BatchingOptions | None = None,
    draining: bool = False,
    **changes: Any,
) -> Any:
    """The Ray Serve application serving the artifact at ``path``: ``serve.run(app)``.

    Ray's deployment options are passed through (``num_replicas`` or
    ``autoscaling_config``, ``ray_actor_options`` such as ``{"num_gpus": 1}``);
    ``max_ongoing_requests`` defaults to ``max_queue`` (the batcher's queue, in rows).
    ``options`` with ``changes`` over them are the model's ``BatchingOptions``, checked
    here (before any replica starts). The same application with ``draining=True``,
    ``serve.run`` again, drains every replica in place (``pxrt serve --ray`` does on
    SIGTERM)."""
    options = BatchingOptions.from_mapping(changes, options)
    deployment_options: dict[str, Any] = {
        "max_ongoing_requests": max_ongoing_requests or options.max_queue,
        # Always set, and a stable code version (below), so that setting draining is an
        # in-place update (no new replicas).
        "user_config": {"draining": draining},
    }
    if num_replicas is not None:
        deployment_options["num_replicas"] = num_replicas
    if autoscaling_config is not None:
        deployment_options["autoscaling_config"] = dict(autoscaling_config)
    if ray_actor_options is not None:
        deployment_options["ray_actor_options"] = dict(ray_actor_options)
    # @serve.deployment made the class a Deployment, which mypy does not see.
    deployment = PxrtDeployment.options(**deployment_options)  # type: ignore[attr-defined]
    version = code_version(path, name, load_options, options)
    try:
        # Ray Serve no longer takes ``version`` from users (``_internal``: as its own
        # deploy path sets it); without it, each ``serve.run`` gets a random one.
        deployment = deployment.options(version=version, _internal=True)
    except (TypeError, ValueError) as exc:  # pragma: no cover - depends on Ray's version
        log.warning("pxrt: Ray Serve takes no code version (%s): a drain replaces replicas", exc)
    return deployment.bind(path, name=name, load_options=load_options, options=options)


def code_version(
    path: str,
    name: str | None,
    load_options: Mapping[str, Any] | None,
    options: BatchingOptions,
) -> str:
    """Ray Serve's code version of a ``pxrt_app``: the same for the same artifact and
    options, so that a ``serve.run`` that changes only the ``user_config`` (draining)
    reconfigures the replicas in place. Ray gives a deployment without one a new version
    on every ``serve.run`` (its client's ``deployment._version or get_random_string()``),
    which replaces every replica: the new ones load the model first, and the old ones,
    never told to drain, stop under the requests they hold. What a replica is built from
    is in it: pxrt's version, the path, the name, the options, and the artifact's
    manifest (it holds each file's sha256) when this process can read it, so an artifact
    exported again at the same path gets new replicas."""
    import pxrt

    try:
        with open(os.path.join(path, "manifest.json"), "rb") as f:
            manifest = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        manifest = ""  # (a path only the replicas' nodes can read)
    loads = sorted((str(k), repr(v)) for k, v in dict(load_options or {}).items())
    what = repr((pxrt.__version__, os.fspath(path), name, loads, options, manifest))
    return "pxrt-" + hashlib.sha256(what.encode()).hexdigest()[:16]
