"""A front-end worker of ``pxrt serve --workers N`` (``serving.workers.supervisor.Supervisor``
starts it; nothing else should).

It serves HTTP (uvicorn on the shared listening socket, with the connection guard and
the native path) and gRPC (pxrt's HTTP/2) exactly as one ``pxrt serve`` process does,
over a ``serving.workers.remote.RemoteServer``: inference goes to the device process's queue,
everything else is answered there. It parses ``pxrt serve``'s own arguments for its
limits; its share of the connection cap and of the request-body budget is ``1/N``.
SIGTERM: stop accepting, answer what it accepted, exit. A worker whose device process
is gone exits.

    python -m serving.workers.worker --ipc-fd FD --http-fd FD [--grpc-fd FD] --index I/N -- ARGS
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
from typing import Any


def _parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    own = argparse.ArgumentParser(prog="serving.workers.worker")
    own.add_argument("--ipc-fd", type=int, required=True)
    own.add_argument("--http-fd", type=int, required=True)
    own.add_argument("--grpc-fd", type=int, default=None)
    own.add_argument("--index", required=True, help="I/N: this worker's index and the count")
    if "--" not in argv:
        own.error("pxrt serve's arguments follow --")
    split = argv.index("--")
    args = own.parse_args(argv[:split])
    serve_argv = argv[split + 1 :]
    if serve_argv[:1] == ["serve"]:
        serve_argv = serve_argv[1:]
    from ..config import add_arguments

    serve = argparse.ArgumentParser(prog="pxrt serve")
    add_arguments(serve)
    return args, serve.parse_args(serve_argv)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from ..access import Restrictions, TlsFiles
    from ..config import connection_shares, generation_limits, grpc_limits, http_limits, tracing
    from ..grpc.native import GrpcServer
    from ..http.app import AppState, InferEndpoint, KServeApp, generation_app
    from ..http.limits import GuardedServer, guarded_protocol
    from ..kserve.core import BodyBudget
    from ..loops import new_event_loop
    from .remote import DeviceLink, ForwardApp, RemoteServer

    args, opts = _parse(sys.argv[1:] if argv is None else argv)
    index, count = (int(x) for x in args.index.split("/"))
    http_share, grpc_share = connection_shares(opts)
    limits = http_limits(opts, max(1, http_share // count))
    limits = limits.replace(max_pending_body_bytes=max(1, limits.max_pending_body_bytes // count))
    restrictions = Restrictions.parse(opts.restricted_api)
    tls = TlsFiles.from_args(opts)

    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    remote = RemoteServer(generation_limits(opts), tracing(opts))
    state = AppState(
        remote,
        limits,
        BodyBudget(limits.max_pending_body_bytes),
        None,
        restrictions,
    )
    forward = ForwardApp(remote, limits.max_body_bytes)
    # Inference and generation are answered here (over the device process's queue and
    # decoders); everything else is forwarded.
    app = KServeApp(generation_app(state, forward), InferEndpoint(state))
    config = uvicorn.Config(
        app,
        http=guarded_protocol(limits, remote, native=state if opts.native_http else None),
        lifespan="off",
        ws="none",  # (as pxrt serve's: an upgrade is answered 400)
        log_level=opts.log_level,
        timeout_graceful_shutdown=30,
        **(tls.uvicorn_options() if tls else {}),
    )

    class Uvicorn(GuardedServer):
        @contextlib.contextmanager
        def capture_signals(self):
            # SIGTERM (from the device process): shut down gracefully and exit 0; SIGINT
            # (Ctrl-C reaches the whole process group): the device process decides.
            signal.signal(signal.SIGTERM, self.handle_exit)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            yield

    uv = Uvicorn(config, socket.socket(fileno=args.http_fd), shared=True)

    def device_gone() -> None:
        uv.should_exit = True

    async def run() -> None:
        ipc_sock = socket.socket(fileno=args.ipc_fd)
        await loop.connect_accepted_socket(lambda: DeviceLink(remote, device_gone), ipc_sock)
        await remote.started.wait()
        grpc_server: Any = None
        if args.grpc_fd is not None:
            grpc_server = GrpcServer(
                remote,
                max_message_bytes=limits.max_body_bytes,
                limits=grpc_limits(opts, max(1, grpc_share // count)),
                restrictions=restrictions,
                budget=state.budget,
                body_timeout_s=limits.body_timeout_s,
                forward=remote.forward_grpc,
            )
            await grpc_server.start(opts.host, 0, tls, sock=socket.socket(fileno=args.grpc_fd))
        try:
            await uv.serve()
        finally:
            if grpc_server is not None:
                await grpc_server.stop(5.0)
            remote.close()

    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
