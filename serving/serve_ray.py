"""``pxrt serve --ray``: one model on ``--replicas`` Ray Serve replicas (the ray extra),
KServe v2 HTTP on Ray's proxy, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from .access import TlsFiles
from .config import model_specs
from .options import OptionError

# After the replicas drain: how long requests already in flight (queued in Ray's proxy or
# a replica) have to finish before Serve shuts down.
DRAIN_GRACE_S = 2.0

# Ray Serve's controller kills a proxy that misses 3 health checks in a row (10 s each)
# and restarts it, which drops every connection it holds; it also gives a starting proxy
# 5 s to be ready. A proxy that is slow because the host is busy (found on a 2-core
# machine under load: every client lost its connection mid-run) is better waited for.
# Read by the controller when a local Ray starts here (set in the environment the
# started processes inherit); whatever the environment sets already wins.
PROXY_TIMEOUTS = {
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
}


def _wait_draining(args: argparse.Namespace, https: bool, timeout_s: float = 15.0) -> None:
    """Until the proxy's readiness answers "draining" several times in a row (each
    answer from a replica Ray picks), or ``timeout_s``: ``serve.run`` may return before
    every replica has taken the update."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"{'https' if https else 'http'}://{host}:{args.port}/v2/health/ready"
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # our own proxy, on this machine
    in_a_row, deadline = 0, time.monotonic() + timeout_s
    while in_a_row < 2 * args.replicas + 2 and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5, context=context if https else None):
                in_a_row = 0  # 200: a replica still takes requests
        except urllib.error.HTTPError as exc:
            in_a_row = in_a_row + 1 if exc.code == 503 else 0
        except OSError:
            in_a_row = 0
        time.sleep(0.05)


def _replicas_serve(serve: Any) -> bool:
    """Whether a replica of the application runs (takes requests), whatever the state
    of the others (``serve.run`` returns once every replica runs)."""
    try:
        status = serve.status().applications.get("pxrt")
    except Exception:  # noqa: BLE001 - Serve did not start: nothing serves
        return False
    if status is None:
        return False
    return any(
        count and state in ("RUNNING", "UPDATING")
        for deployment in status.deployments.values()
        for state, count in deployment.replica_states.items()
    )


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
    # Ray's proxy owns the connections: what it cannot enforce is refused, not ignored.
    if args.restricted_api or args.tls_ca:
        print(
            "pxrt serve: error: with --ray, Ray's HTTP proxy serves the requests, and it "
            "enforces neither --restricted-api nor client certificates (--tls-ca); put a "
            "proxy that does in front of it",
            file=sys.stderr,
        )
        return 2
    try:
        tls = TlsFiles.from_args(args)
    except (OptionError, OSError) as exc:
        print(f"pxrt serve: error: {exc}", file=sys.stderr)
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
        name, path, options, place = specs[0]
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

        for key, value in PROXY_TIMEOUTS.items():
            os.environ.setdefault(key, value)
        # None: RAY_ADDRESS, else the cluster last started on this machine, else a new one.
        ray.init(address=args.ray_address)
        # After ray.init, which installs its own SIGTERM handler (it aborts the process).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        try:
            http_options: dict[str, Any] = {"host": args.host, "port": args.port}
            if tls is not None:
                http_options.update(ssl_certfile=tls.cert, ssl_keyfile=tls.key)
            serve.start(http_options=http_options)

            def app(draining: bool = False) -> Any:
                return pxrt_app(
                    os.path.abspath(path),
                    name=name,
                    num_replicas=args.replicas,
                    ray_actor_options={
                        "num_cpus": args.replica_cpus,
                        "num_gpus": args.replica_gpus,
                    },
                    options=options,
                    load_options=place.load_options(),
                    draining=draining,
                )

            def drain() -> None:
                # Every replica answers 503 to new requests from now on (an in-place
                # update: pxrt_app's code version stays), the requests it accepted
                # finish, then Serve stops. Not waiting for the application to run:
                # replicas still starting (one that cannot be placed may never start)
                # hold no request, and readiness says when the serving ones drain.
                print("pxrt serve: draining", file=sys.stderr)
                serve._run(app(draining=True), name="pxrt", route_prefix="/", _blocking=False)
                _wait_draining(args, tls is not None)
                time.sleep(DRAIN_GRACE_S)

            serve.run(app(), name="pxrt", route_prefix="/")
            started.set()
            print(
                f"pxrt serve: ready on {'https' if tls else 'http'}://{args.host}:{args.port} "
                f"({args.replicas} Ray Serve replicas)",
                file=sys.stderr,
            )
            stop.wait()
            drain()
        except KeyboardInterrupt:  # a requested stop, as any other: exit 0
            started.set()  # (another signal now only asks again)
            if _replicas_serve(serve):
                # Stopped before serve.run returned, with replicas serving already
                # (the proxy answers as soon as one does): they drain as on any stop.
                drain()
            else:
                print("pxrt serve: stopped while deploying", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - a deployment that failed to start
            print(f"pxrt serve: error: {exc}", file=sys.stderr)
            return 2
        finally:
            serve.shutdown()
            ray.shutdown()
    return 0
