"""``pxrt serve``: the standalone KServe v2 server (uvicorn on uvloop + httptools; with
``--grpc-port``, gRPC on pxrt's own HTTP/2 too, or grpcio's asyncio server with
``--no-native-grpc``, on the same loop). Its flags and TOML file are
``serving.config``'s; ``--ray`` is ``serving.serve_ray``'s.

The HTTP server starts at once and answers ``/v2/health/live``; models load and compile
in a worker thread, and ``/v2/health/ready`` turns 200 when all are warm. SIGTERM or
Ctrl-C: stop accepting, answer every accepted request, exit 0.

``--workers N`` (N > 1): this process is the device process (models, batching,
devices) and ``N`` front-end worker processes share its listening sockets
(``serving.workers.supervisor``); the same answers, the same drain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import os
import signal
import sys
import tempfile
from typing import Any

from .access import Restrictions, TlsFiles
from .config import (
    add_arguments,
    connection_shares,
    distributed_config,
    generation_limits,
    grpc_limits,
    http_limits,
    model_specs,
    repository_config,
    tracing,
)
from .logs import printable
from .options import OptionError

__all__ = ["add_arguments", "main"]


def refreeze_gc() -> None:
    """``pxrt serve``'s garbage-collector policy, run after start-up and after each load
    or unload: collect, then freeze what is left (jax's many objects leave the
    collector's view, so its full passes do not stall the loop), unfreezing first so
    that an unloaded model's cycles are collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class _Setup:
    """What both ways of serving share: the checked options, the ``Server``, the
    repository, and the loading of every model."""

    def __init__(self, args: argparse.Namespace, demo_dir: str) -> None:
        from .engine.server import Server

        self.args = args
        self.http_connections, self.grpc_connections = connection_shares(args)
        self.restrictions = Restrictions.parse(args.restricted_api)
        self.tls = TlsFiles.from_args(args)
        self.limits = http_limits(args, self.http_connections)
        self.specs = model_specs(args, demo_dir)
        #: A multi-host group's place (``pxrt.multihost.Distributed``), else None.
        self.distributed = distributed_config(args, len(self.specs))
        if self.distributed is not None:
            import jax

            # jax's preemption service would take SIGTERM, which pxrt serve drains on.
            jax.config.update("jax_enable_preemption_service", False)
        #: Models to ``close`` at exit (a multi-host leader's: its followers stop).
        self.closing: list[Any] = []
        self.server = Server(
            ready=False,
            on_models_changed=refreeze_gc,
            generation_limits=generation_limits(args),
            response_cache_mb=args.response_cache_mb,
            tracing=tracing(args),
            allow_client_shm=args.allow_client_shm,
            allow_remote_shm=args.allow_remote_shm,
        )
        self.repository: Any = None
        self.poller: list[asyncio.Future] = []
        self.loading_error: list[BaseException] = []
        if args.model_repository:
            from .engine.repository import Repository

            defaults, repo_options, policies, may_change, placements = repository_config(args)
            self.repository = Repository(
                args.model_repository,
                self.server,
                mode=args.model_control_mode,
                policies=policies,
                defaults=defaults,
                options=repo_options,
                allow_signature_change=may_change,
                load_options=placements[""].load_options(),
                model_load_options={
                    name: p.load_options() for name, p in placements.items() if name
                },
            )
        elif args.load_model or args.model_control_mode != "none":
            raise OptionError("--model-control-mode and --load-model need --model-repository")

    def grpc_limits(self, share: int) -> Any:
        return grpc_limits(self.args, share)

    async def load_all(self) -> None:
        """Load every model, start the repository, then turn ready (a failure is kept
        in ``loading_error`` and raised)."""
        import pxrt

        args, server, repository = self.args, self.server, self.repository
        try:
            for name, path, options, place in self.specs:
                load_options = place.load_options()
                if self.distributed is not None:
                    load_options["distributed"] = self.distributed
                model = await asyncio.to_thread(pxrt.load, path, **load_options)
                if getattr(model, "group", None) is not None:  # a multi-host leader
                    self.closing.append(model)
                    model.group.on_broken(
                        functools.partial(_on_broken, asyncio.get_running_loop(), server)
                    )
                if isinstance(model, pxrt.Decoder):
                    server.add_decoder(name or model.name, model, options)
                    chunked = (
                        (f", chunks {model.chunk_lengths}" if model.chunk_lengths else "")
                        + (", a prefix cache" if model.prefix is not None else "")
                        + f", steps over {list(model.step_slots)} slots"
                    )
                    print(
                        f"pxrt serve: {name or model.name} ready (a decoder: {model.slots} "
                        f"slots, {model.max_length} positions, prefill lengths "
                        f"{model.prefill_lengths}{chunked}, {len(model.devices)} device(s)); "
                        f"{model.load_summary()}",
                        file=sys.stderr,
                    )
                    continue
                server.add_model(name or model.name, model, options)
                dims = "".join(f", {d} {v}" for d, v in model.dim_buckets.items())
                print(
                    f"pxrt serve: {name or model.name} ready (buckets {model.buckets}"
                    f"{dims}, {len(model.devices)} device(s)); {model.load_summary()}",
                    file=sys.stderr,
                )
            if repository is not None:
                await repository.start(args.load_model)
                for row in repository.index():
                    line = (
                        f"repository {row['name']} version {row['version']}: "
                        f"{row['state']} {row['reason']}"
                    )
                    print(f"pxrt serve: {printable(line).rstrip()}", file=sys.stderr)
                if args.model_control_mode == "poll":
                    self.poller.append(
                        asyncio.ensure_future(repository.poll_forever(args.repository_poll_secs))
                    )
            refreeze_gc()
            server.ready = True
            scheme = "https" if self.tls else "http"
            workers = f" ({args.workers} workers)" if args.workers > 1 else ""
            started = process_age_s()
            print(
                f"pxrt serve: ready on {scheme}://{args.host}:{args.port}{workers}"
                + (f", {started:.2f} s after the process started" if started else ""),
                file=sys.stderr,
            )
        except asyncio.CancelledError:
            raise  # stopped while loading: not an error
        except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
            self.loading_error.append(exc)
            raise

    def stop_polling(self) -> None:
        for task in self.poller:
            task.cancel()


def _on_broken(loop: asyncio.AbstractEventLoop, server: Any, why: str) -> None:
    """A multi-host group broke (on its reader's thread): the server refuses inference."""
    loop.call_soon_threadsafe(server.fail, why)


def main(args: argparse.Namespace) -> int:
    if args.ray and args.coordinator is not None:
        print("pxrt serve: error: --ray does not go with a multi-host group (--coordinator)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.ray:
        if args.workers > 1:
            print("pxrt serve: error: --workers is for pxrt's own front end, not --ray "
                  "(Ray's proxy takes the connections)", file=sys.stderr)  # fmt: skip
            return 2
        from .serve_ray import main_ray

        return main_ray(args)
    if args.grpc_port is not None:
        try:
            from .grpc import service as grpc_server  # noqa: F401 - fail now, not once serving
        except ImportError as exc:
            print(
                f"pxrt serve: error: --grpc-port needs the grpc extra ({exc}): "
                "pip install 'pxrt[grpc]'",
                file=sys.stderr,
            )
            return 2
    if args.workers > 1 and args.grpc_port is not None and not args.native_grpc:
        print(
            "pxrt serve: error: --workers serves gRPC on pxrt's HTTP/2 only (no --no-native-grpc)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="pxrt-serve-") as demo_dir:
        try:
            setup = _Setup(args, demo_dir)
        except (OptionError, OSError, ValueError) as exc:
            print(f"pxrt serve: error: {exc}", file=sys.stderr)
            return 2
        if setup.distributed is not None and not setup.distributed.leader:
            from .follower import run_follower

            return run_follower(setup.distributed, setup.specs[0][1], args)
        run = _run_workers if args.workers > 1 else _run_one
        code = run(setup)
        if setup.loading_error:
            print(f"pxrt serve: error: {printable(setup.loading_error[0])}", file=sys.stderr)
            return 2
    return code


def _run_one(setup: _Setup) -> int:
    """One process: uvicorn (and gRPC) on this process's loop."""
    import uvicorn

    from .accept import listening_socket
    from .http.app import create_app
    from .http.limits import GuardedServer, guarded_protocol
    from .loops import new_event_loop

    args, server, limits, tls = setup.args, setup.server, setup.limits, setup.tls
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as exc:
        print(f"pxrt serve: error: cannot listen on {args.host}:{args.port}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 2

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        grpc_server = None
        if args.grpc_port is not None:
            options: dict[str, Any] = dict(
                host=args.host,
                max_message_bytes=limits.max_body_bytes,
                repository=setup.repository,
                restrictions=setup.restrictions,
                tls=tls,
                limits=setup.grpc_limits(setup.grpc_connections),
            )
            if args.native_grpc:
                from .grpc.native import start_grpc

                # One budget of request bytes held over both front ends.
                options.update(budget=state.budget, body_timeout_s=limits.body_timeout_s)
            else:
                from .grpc.service import start_grpc  # type: ignore[assignment]
            grpc_server = await start_grpc(server, args.grpc_port, **options)
            print(f"pxrt serve: gRPC on {args.host}:{args.grpc_port}", file=sys.stderr)

        async def load() -> None:
            try:
                await setup.load_all()
            except BaseException:  # noqa: BLE001 - kept in loading_error; the server stops
                uv.should_exit = True

        loader = asyncio.ensure_future(load())
        yield
        server.drain()
        loader.cancel()
        setup.stop_polling()
        if grpc_server is not None:
            await grpc_server.stop(grace=5.0)  # in-flight calls finish, then it closes
        await server.close()
        for model in setup.closing:
            model.close()

    kserve = create_app(
        server,
        limits=limits,
        lifespan=lifespan,
        repository=setup.repository,
        restrictions=setup.restrictions,
    )
    state = kserve.app.state.pxrt
    config = uvicorn.Config(
        kserve,
        host=args.host,
        port=args.port,
        http=guarded_protocol(limits, server, native=state if args.native_http else None),
        lifespan="on",
        ws="none",  # no WebSocket: an upgrade is answered 400 (serving.http.limits)
        log_level=args.log_level,
        timeout_graceful_shutdown=30,
        **(tls.uvicorn_options() if tls else {}),
    )

    class Uvicorn(GuardedServer):
        def handle_exit(self, sig: int, frame: Any) -> None:
            server.drain()  # requests still arriving get 503 from now on
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the signal after a graceful shutdown, so the
            # process would die of it; a drained server exits 0 instead. The handler
            # stays until the process exits: a second SIGTERM while it finishes
            # shutting down must not kill it either.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
            yield

    uv = Uvicorn(config, sock)
    _serve_until_done(new_event_loop(), uv.serve())
    return 0


def _run_workers(setup: _Setup) -> int:
    """The device process of ``--workers N``: it loads and batches; the workers (which
    share the listening sockets it binds) take the connections."""
    from .accept import listening_socket
    from .grpc.native import methods
    from .grpc.service import GRPCService
    from .http.app import create_app
    from .kserve.shm import WORKERS, SharedMemory
    from .loops import new_event_loop
    from .workers.supervisor import Supervisor

    args, server = setup.args, setup.server
    server.shared_memory = SharedMemory(unavailable=WORKERS)  # (see WORKERS)
    # What workers forward (everything but inference) is answered by this app and service.
    app = create_app(
        server, limits=setup.limits, repository=setup.repository, restrictions=setup.restrictions
    )
    # Without --grpc-port the service only answers what workers forward: default limits.
    limits = setup.grpc_limits(setup.grpc_connections) if args.grpc_port is not None else None
    service = GRPCService(server, setup.repository, limits, setup.restrictions)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        sockets = {"http": listening_socket(args.host, args.port)}
        if args.grpc_port is not None:
            sockets["grpc"] = listening_socket(args.host, args.grpc_port)
        argv = getattr(args, "argv", None) or sys.argv[1:]
        supervisor = Supervisor(server, app, methods(service), argv, args.workers, sockets)
        await supervisor.start()
        print(
            f"pxrt serve: {args.workers} workers on {args.host}:{args.port}"
            + (f", gRPC on {args.host}:{args.grpc_port}" if args.grpc_port is not None else ""),
            file=sys.stderr,
        )
        loader = asyncio.ensure_future(setup.load_all())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loader, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if loader.done() and not loader.cancelled() and loader.exception() is None:
            await stopped
        server.drain()  # the workers are told; what they send from now on gets 503
        loader.cancel()
        setup.stop_polling()
        # No new worker will need the listening sockets: once the workers close theirs,
        # new connections are refused instead of waiting in a backlog nobody accepts.
        for sock in sockets.values():
            sock.close()
        await supervisor.stop(grace_s=35.0)  # each answers what it accepted, then exits
        await server.close()

    _serve_until_done(new_event_loop(), run())
    return 0


def _serve_until_done(loop: asyncio.AbstractEventLoop, main: Any) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        loop.close()
        # Drained: what is left is the interpreter's teardown, which resets Python's
        # signal handlers to the default (a late SIGTERM would kill the process) but
        # leaves ignored signals ignored.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): what a user
    waits from the command to ready, imports included."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
