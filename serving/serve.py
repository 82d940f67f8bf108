"""``pxrt serve``: the standalone KServe v2 server (uvicorn on uvloop + httptools; with
``--grpc-port``, gRPC on pxrt's own HTTP/2 too, or grpcio's asyncio server with
``--no-native-grpc``, on the same loop). Its flags and TOML file are
``serving.config``'s; ``--ray`` is ``serving.serve_ray``'s.

The HTTP server starts at once and answers ``/v2/health/live``; models load and compile
in a worker thread, and ``/v2/health/ready`` turns 200 when all are warm. SIGTERM or
Ctrl-C: stop accepting, answer every accepted request, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import signal
import sys
import tempfile
from typing import Any

from .access import Restrictions, TlsFiles
from .config import add_arguments, connection_shares, http_limits, model_specs, repository_config
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


def main(args: argparse.Namespace) -> int:
    import uvicorn

    import pxrt

    from .http import create_app
    from .http_limits import guarded_protocol
    from .server import Server, new_event_loop

    if args.ray:
        from .serve_ray import main_ray

        return main_ray(args)
    if args.grpc_port is not None:
        try:
            from . import grpc_server  # noqa: F401 - fail now, not once serving
        except ImportError as exc:
            print(
                f"pxrt serve: error: --grpc-port needs the grpc extra ({exc}): "
                "pip install 'pxrt[grpc]'",
                file=sys.stderr,
            )
            return 2
    http_connections, grpc_connections = connection_shares(args)
    try:
        restrictions = Restrictions.parse(args.restricted_api)
        tls = TlsFiles.from_args(args)
    except (OptionError, OSError) as exc:
        print(f"pxrt serve: error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pxrt-serve-") as demo_dir:
        specs = model_specs(args, demo_dir)
        server = Server(ready=False, on_models_changed=refreeze_gc)
        loading_error: list[BaseException] = []
        repository = None
        if args.model_repository:
            from .repository import Repository

            defaults, repo_options, policies, may_change = repository_config(args)
            try:
                repository = Repository(
                    args.model_repository,
                    server,
                    mode=args.model_control_mode,
                    policies=policies,
                    defaults=defaults,
                    options=repo_options,
                    allow_signature_change=may_change,
                )
            except (OSError, ValueError) as exc:
                print(f"pxrt serve: error: {exc}", file=sys.stderr)
                return 2
        elif args.load_model or args.model_control_mode != "none":
            print(
                "pxrt serve: error: --model-control-mode and --load-model need --model-repository",
                file=sys.stderr,
            )
            return 2
        poller: list[asyncio.Future] = []

        async def load_all() -> None:
            try:
                for name, path, options in specs:
                    model = await asyncio.to_thread(pxrt.load, path)
                    server.add_model(name or model.name, model, options)
                    dims = "".join(f", {d} {v}" for d, v in model.dim_buckets.items())
                    print(
                        f"pxrt serve: {name or model.name} ready (buckets {model.buckets}"
                        f"{dims}, {len(model.devices)} device(s))",
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
                        poller.append(
                            asyncio.ensure_future(
                                repository.poll_forever(args.repository_poll_secs)
                            )
                        )
                refreeze_gc()
                server.ready = True
                scheme = "https" if tls else "http"
                print(f"pxrt serve: ready on {scheme}://{args.host}:{args.port}", file=sys.stderr)
            except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
                loading_error.append(exc)
                uv.should_exit = True

        @contextlib.asynccontextmanager
        async def lifespan(app: Any):
            grpc_server = None
            if args.grpc_port is not None:
                from .grpc_server import GrpcLimits

                options: dict[str, Any] = dict(
                    host=args.host,
                    max_message_bytes=int(args.max_body_mb * (1 << 20)),
                    repository=repository,
                    restrictions=restrictions,
                    tls=tls,
                    limits=GrpcLimits(
                        max_connections=grpc_connections,
                        handshake_timeout_s=args.header_timeout_s,
                        max_stream_inflight=args.max_stream_inflight,
                    ),
                )
                if args.native_grpc:
                    from .grpc_native import start_grpc

                    # One budget of request bytes held over both front ends.
                    options.update(
                        budget=app.state.pxrt.budget, body_timeout_s=limits.body_timeout_s
                    )
                else:
                    from .grpc_server import start_grpc  # type: ignore[assignment]
                grpc_server = await start_grpc(server, args.grpc_port, **options)
                print(f"pxrt serve: gRPC on {args.host}:{args.grpc_port}", file=sys.stderr)
            loader = asyncio.ensure_future(load_all())
            yield
            server.drain()
            loader.cancel()
            for task in poller:
                task.cancel()
            if grpc_server is not None:
                await grpc_server.stop(grace=5.0)  # in-flight calls finish, then it closes
            await server.close()

        limits = http_limits(args, http_connections)
        app = create_app(
            server,
            limits=limits,
            lifespan=lifespan,
            repository=repository,
            restrictions=restrictions,
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            http=guarded_protocol(
                limits, server, native=app.state.pxrt if args.native_http else None
            ),
            lifespan="on",
            log_level=args.log_level,
            timeout_graceful_shutdown=30,
            # Connections waiting to be accepted (the kernel caps it at somaxconn):
            # thousands of clients connecting at once wait there, not refused.
            backlog=4096,
            **(tls.uvicorn_options() if tls else {}),
        )

        class Uvicorn(uvicorn.Server):
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

        uv = Uvicorn(config)
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(uv.serve())
        finally:
            loop.close()
            # Drained: what is left is the interpreter's teardown, which resets Python's
            # signal handlers to the default (a late SIGTERM would kill the process) but
            # leaves ignored signals ignored.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        if loading_error:
            print(f"pxrt serve: error: {printable(loading_error[0])}", file=sys.stderr)
            return 2
    return 0
