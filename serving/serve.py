"""``pxrt serve``: the standalone KServe v2 server (uvicorn on uvloop + httptools; with
``--grpc-port``, grpcio's asyncio server too, on the same loop).

The HTTP server starts at once and answers ``/v2/health/live``; models load and compile
in a worker thread, and ``/v2/health/ready`` turns 200 when all are warm. SIGTERM or
Ctrl-C: stop accepting, answer every accepted request, exit 0.

Per-model batching options come from flags (defaults for every model) or a TOML file::

    [defaults]
    max_delay_us = 2000

    [models.mlp]
    path = "models/mlp"
    max_batch_size = 64

    [models.encoder]
    path = "models/encoder"
    cell_policy = "cost"     # models with named dimensions: "cost" or "oldest"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
import tempfile
import threading
import tomllib
from typing import Any

from .protocol import Limits, guarded_protocol


class _Number:
    """An option's value check: its type, and its lower bound (inclusive or not). Used
    by argparse for flags and for the TOML file, so bad values stop the server at
    start-up with a message instead of failing every request."""

    def __init__(self, kind: type, low: float, inclusive: bool = True) -> None:
        self.kind, self.low, self.inclusive = kind, low, inclusive
        self.__name__ = kind.__name__  # argparse names the type in its errors

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        return f"{what} {'>=' if self.inclusive else '>'} {self.low:g}"

    def __call__(self, value: Any) -> Any:
        try:
            if isinstance(value, bool) or (self.kind is int and isinstance(value, float)):
                raise ValueError
            number = self.kind(value)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{value!r} is not {self.describe()}") from None
        if not (number >= self.low if self.inclusive else number > self.low) or number != number:
            raise argparse.ArgumentTypeError(f"{value!r} is not {self.describe()}")
        return number


class _Choice:
    """An option's value check for one of a few names (see ``_Number``)."""

    def __init__(self, *choices: str) -> None:
        self.choices = choices
        self.__name__ = "choice"

    def __call__(self, value: Any) -> str:
        if value not in self.choices:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(self.choices)}")
        return value


OPTIONS = {
    "max_batch_size": _Number(int, 1),
    "max_delay_us": _Number(float, 0),
    "max_queue": _Number(int, 1),
    "default_timeout_s": _Number(float, 0, inclusive=False),
    "max_inflight": _Number(int, 1),
    "cell_policy": _Choice("cost", "oldest"),
}
OPTION_KEYS = tuple(OPTIONS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dirs", nargs="*", help="artifact directories (default: the demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_Number(int, 0), default=8000)
    p.add_argument(
        "--grpc-port",
        type=_Number(int, 0),
        default=None,
        help="also serve KServe v2 over gRPC on this port (default: HTTP only)",
    )
    p.add_argument("--config", metavar="TOML", help="per-model options (see pxrt serve --help)")
    p.add_argument(
        "--model-repository",
        metavar="DIR",
        help="serve the models of DIR/<model>/<version>/ (artifact directories)",
    )
    p.add_argument(
        "--model-control-mode",
        choices=("none", "explicit", "poll"),
        default="none",
        help="none: the repository's models at start, no changes; explicit: only what "
        "--load-model names and the load/unload API asks; poll: rescan for new and "
        "removed versions (default none)",
    )
    p.add_argument(
        "--load-model", action="append", default=[], metavar="NAME",
        help="explicit mode: load this repository model at start (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--repository-poll-secs", type=_Number(float, 0, inclusive=False), default=15.0,
        help="poll mode: seconds between scans of the repository (default 15)",
    )  # fmt: skip
    ray = p.add_argument_group("Ray Serve (the ray extra)")
    ray.add_argument(
        "--ray", action="store_true",
        help="serve the model as a Ray Serve application of --replicas pxrt replicas, "
        "KServe v2 HTTP on Ray's proxy at --host/--port",
    )  # fmt: skip
    ray.add_argument("--replicas", type=_Number(int, 1), default=1, help="default 1")
    ray.add_argument(
        "--ray-address", default=None,
        help="a running Ray cluster (default: RAY_ADDRESS, else the cluster last started on "
        "this machine, else a new local one)",
    )  # fmt: skip
    ray.add_argument("--replica-cpus", type=_Number(float, 0), default=1.0, help="default 1")
    ray.add_argument("--replica-gpus", type=_Number(float, 0), default=0.0, help="default 0")
    for key, check in OPTIONS.items():
        p.add_argument("--" + key.replace("_", "-"), type=check, default=None)
    positive = _Number(float, 0, inclusive=False)
    limits = Limits()
    server_flags = [  # flag, check, default, help
        ("--max-body-mb", positive, 64.0, "larger bodies get 413"),
        ("--max-json-mb", positive, 16.0,
         "larger JSON parts get 413 (send large tensors as binary data)"),
        ("--max-pending-body-mb", positive, 512.0,
         "request bodies held at once, over all requests; more get 503"),
        ("--max-connections", _Number(int, 2), min(limits.max_connections, _fd_budget()),
         "open connections over every listener (HTTP and gRPC); new ones beyond a "
         "listener's share are closed at once"),
        ("--max-header-kb", positive, limits.max_header_bytes / 1024,
         "a request's URL and headers; more get 431"),
        ("--header-timeout-s", positive, limits.header_timeout_s,
         "time to send the headers, from connecting or the request's start (408); "
         "for gRPC, to send the HTTP/2 settings after connecting"),
        ("--body-timeout-s", positive, limits.body_timeout_s, "a body's longest pause (408)"),
        ("--request-timeout-s", positive, limits.request_timeout_s,
         "time to send a whole request (408)"),
    ]  # fmt: skip
    for flag, check, default, text in server_flags:
        p.add_argument(flag, type=check, default=default, help=f"{text} (default {default:g})")
    p.add_argument(
        "--max-grpc-connections", type=_Number(int, 1), default=None,
        help="gRPC's share of --max-connections (default a quarter: gRPC clients "
        "multiplex calls on one connection); HTTP gets the rest",
    )  # fmt: skip
    p.add_argument("--log-level", default="warning")


def _fd_budget() -> int:
    """Connections this process can hold with file descriptors to spare."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not on this platform
        return 1000
    return max(16, soft - 64) if soft != resource.RLIM_INFINITY else 1000


def connection_shares(args: argparse.Namespace) -> tuple[int, int]:
    """(HTTP's, gRPC's) connections: one budget, ``--max-connections``, over every
    listener, so that together they never exhaust the file descriptors (a flood of
    sockets on one port cannot take the other down). gRPC's share is 0 without it."""
    total = args.max_connections
    budget = _fd_budget()
    if total > budget:
        raise SystemExit(
            f"pxrt serve: error: --max-connections {total} is over what the file "
            f"descriptor limit allows ({budget}, ulimit -n less 64 to spare); raise the "
            "limit or lower --max-connections"
        )
    if args.grpc_port is None:
        return total, 0
    grpc = args.max_grpc_connections or max(1, total // 4)
    if grpc >= total:
        raise SystemExit(
            f"pxrt serve: error: --max-grpc-connections {grpc} leaves no connection of "
            f"--max-connections {total} to HTTP"
        )
    return total - grpc, grpc


def model_specs(args: argparse.Namespace, demo_dir: str) -> list[tuple[str | None, str, dict]]:
    """(name or None for the manifest's, path, options) per model to serve."""
    defaults, sections = _config(args)
    specs: list[tuple[str | None, str, dict]] = []
    for name, section in sections.items():
        if "path" not in section:
            if args.model_repository:
                continue  # a repository model's options: see repository_config
            raise SystemExit(f"pxrt serve: [models.{name}] in {args.config} needs a path")
        if "version_policy" in section:
            raise SystemExit(
                f"pxrt serve: version_policy in [models.{name}] is for models of the "
                "--model-repository"
            )
        extra = {k: v for k, v in section.items() if k != "path"}
        specs.append((name, section["path"], defaults | _options(extra, f"[models.{name}]")))
    specs += [(None, path, dict(defaults)) for path in args.model_dirs]
    if not specs and not args.model_repository:
        from pxrt import demo

        specs.append((None, demo.export_demo(os.path.join(demo_dir, "mlp")), dict(defaults)))
    return specs


def repository_config(args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """(defaults, name -> options, name -> version policy) for the repository's models,
    from the flags and the TOML's ``[defaults]`` and path-less ``[models.NAME]``."""
    from .repository import parse_policy

    defaults, sections = _config(args)
    options: dict[str, dict] = {}
    policies: dict[str, str] = {}
    for name, section in sections.items():
        if "path" in section:
            continue
        extra = {k: v for k, v in section.items() if k != "version_policy"}
        options[name] = _options(extra, f"[models.{name}]")
        if "version_policy" in section:
            try:
                parse_policy(section["version_policy"])
            except ValueError as exc:
                raise SystemExit(f"pxrt serve: [models.{name}] in {args.config}: {exc}") from None
            policies[name] = section["version_policy"]
    return defaults, options, policies


def _config(args: argparse.Namespace) -> tuple[dict, dict]:
    """(the options every model gets: the flags, then the TOML's ``[defaults]``; the
    TOML's ``[models.NAME]`` sections)."""
    defaults = {k: getattr(args, k) for k in OPTION_KEYS if getattr(args, k) is not None}
    if not args.config:
        return defaults, {}
    with open(args.config, "rb") as f:
        conf = tomllib.load(f)
    return defaults | _options(conf.get("defaults", {}), "[defaults]"), conf.get("models", {})


def _options(section: dict, where: str) -> dict:
    unknown = set(section) - set(OPTION_KEYS)
    if unknown:
        raise SystemExit(
            f"pxrt serve: unknown option(s) {sorted(unknown)} in {where}; "
            f"known: {', '.join(OPTION_KEYS)}"
        )
    checked = {}
    for key, value in section.items():
        try:
            checked[key] = OPTIONS[key](value)
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"pxrt serve: {key} in {where}: {exc}") from None
    return checked


def main(args: argparse.Namespace) -> int:
    import uvicorn

    import pxrt

    from .http import State, create_app
    from .server import Server, new_event_loop

    if args.ray:
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
    with tempfile.TemporaryDirectory(prefix="pxrt-serve-") as demo_dir:
        specs = model_specs(args, demo_dir)
        server = Server()
        state = State()
        loading_error: list[BaseException] = []
        repository = None
        if args.model_repository:
            from .repository import Repository

            defaults, repo_options, policies = repository_config(args)
            try:
                repository = Repository(
                    args.model_repository,
                    server,
                    mode=args.model_control_mode,
                    policies=policies,
                    defaults=defaults,
                    options=repo_options,
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
                    server.add_model(name or model.name, model, **options)
                    dims = "".join(f", {d} {v}" for d, v in model.dim_buckets.items())
                    print(
                        f"pxrt serve: {name or model.name} ready (buckets {model.buckets}"
                        f"{dims}, {len(model.devices)} device(s))",
                        file=sys.stderr,
                    )
                if repository is not None:
                    await repository.start(args.load_model)
                    for row in repository.index():
                        print(
                            f"pxrt serve: repository {row['name']} version {row['version']}: "
                            f"{row['state']} {row['reason']}".rstrip(),
                            file=sys.stderr,
                        )
                    if args.model_control_mode == "poll":
                        poller.append(
                            asyncio.ensure_future(
                                repository.poll_forever(args.repository_poll_secs)
                            )
                        )
                # jax's many objects leave the collector's view (its full passes stall the loop).
                gc.collect()
                gc.freeze()
                state.ready = True
                print(f"pxrt serve: ready on http://{args.host}:{args.port}", file=sys.stderr)
            except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
                loading_error.append(exc)
                uv.should_exit = True

        @contextlib.asynccontextmanager
        async def lifespan(app: Any):
            grpc_server = None
            if args.grpc_port is not None:
                from .grpc_server import GrpcLimits, start_grpc

                grpc_server = await start_grpc(
                    server,
                    args.grpc_port,
                    state,
                    host=args.host,
                    max_message_bytes=int(args.max_body_mb * (1 << 20)),
                    repository=repository,
                    limits=GrpcLimits(
                        max_connections=grpc_connections,
                        handshake_timeout_s=args.header_timeout_s,
                    ),
                )
                print(f"pxrt serve: gRPC on {args.host}:{args.grpc_port}", file=sys.stderr)
            loader = asyncio.ensure_future(load_all())
            yield
            state.draining = True
            loader.cancel()
            for task in poller:
                task.cancel()
            if grpc_server is not None:
                await grpc_server.stop(grace=5.0)  # in-flight calls finish, then it closes
            await server.close()

        app = create_app(
            server,
            state=state,
            lifespan=lifespan,
            max_body_bytes=int(args.max_body_mb * (1 << 20)),
            max_json_bytes=int(args.max_json_mb * (1 << 20)),
            max_pending_body_bytes=int(args.max_pending_body_mb * (1 << 20)),
            repository=repository,
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            http=guarded_protocol(
                Limits(
                    max_connections=http_connections,
                    max_header_bytes=int(args.max_header_kb * 1024),
                    header_timeout_s=args.header_timeout_s,
                    body_timeout_s=args.body_timeout_s,
                    request_timeout_s=args.request_timeout_s,
                )
            ),
            lifespan="on",
            log_level=args.log_level,
            timeout_graceful_shutdown=30,
        )

        class Uvicorn(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                state.draining = True  # requests still arriving get 503 from now on
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
            print(f"pxrt serve: error: {loading_error[0]}", file=sys.stderr)
            return 2
    return 0


def main_ray(args: argparse.Namespace) -> int:
    """``pxrt serve --ray``: one model on ``--replicas`` Ray Serve replicas, until
    SIGTERM or Ctrl-C."""
    if args.grpc_port is not None or args.model_repository:
        print(
            "pxrt serve: error: --ray serves one artifact directory over HTTP "
            "(not with --grpc-port or --model-repository)",
            file=sys.stderr,
        )
        return 2
    try:
        import ray
        from ray import serve

        from .ray import pxrt_app
    except ImportError as exc:
        print(f"pxrt serve: error: --ray needs the ray extra ({exc}): pip install 'pxrt[ray]'",
              file=sys.stderr)  # fmt: skip
        return 2
    with tempfile.TemporaryDirectory(prefix="pxrt-serve-") as demo_dir:
        specs = model_specs(args, demo_dir)
        if len(specs) != 1:
            print(f"pxrt serve: error: --ray serves one model, got {len(specs)}", file=sys.stderr)
            return 2
        name, path, options = specs[0]
        import pxrt

        try:  # a bad artifact is reported here, not as a replica that fails to start
            pxrt.read_artifact(path)
        except (OSError, ValueError) as exc:
            print(f"pxrt serve: error: {exc}", file=sys.stderr)
            return 2
        stop = threading.Event()
        started = threading.Event()

        def on_signal(*_: Any) -> None:
            stop.set()
            if not started.is_set():  # still deploying: stop waiting for it
                raise KeyboardInterrupt

        # None: RAY_ADDRESS, else the cluster last started on this machine, else a new one.
        ray.init(address=args.ray_address)
        # After ray.init, which installs its own SIGTERM handler (it aborts the process).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            app = pxrt_app(
                os.path.abspath(path),
                name=name,
                num_replicas=args.replicas,
                ray_actor_options={"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus},
                **options,
            )
            serve.run(app, name="pxrt", route_prefix="/")
            started.set()
            print(
                f"pxrt serve: ready on http://{args.host}:{args.port} "
                f"({args.replicas} Ray Serve replicas)",
                file=sys.stderr,
            )
            stop.wait()
        except KeyboardInterrupt:  # a requested stop, as any other: exit 0
            print("pxrt serve: stopped while deploying", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - a deployment that failed to start
            print(f"pxrt serve: error: {exc}", file=sys.stderr)
            return 2
        finally:
            serve.shutdown()
            ray.shutdown()
    return 0
