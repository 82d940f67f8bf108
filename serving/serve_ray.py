"""``pxrt serve --ray``: one model on ``--replicas`` Ray Serve replicas (the ray extra),
KServe v2 HTTP on Ray's proxy, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from .config import model_specs

# After the replicas drain: how long requests already in flight (queued in Ray's proxy or
# a replica) have to finish before Serve shuts down.
DRAIN_GRACE_S = 2.0


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
                    draining=draining,
                )

            serve.run(app(), name="pxrt", route_prefix="/")
            started.set()
            print(
                f"pxrt serve: ready on http://{args.host}:{args.port} "
                f"({args.replicas} Ray Serve replicas)",
                file=sys.stderr,
            )
            stop.wait()
            # Drain: every replica answers 503 to new requests from now on (an in-place
            # update), the requests it accepted finish, then Serve stops.
            print("pxrt serve: draining", file=sys.stderr)
            serve.run(app(draining=True), name="pxrt", route_prefix="/")
            time.sleep(DRAIN_GRACE_S)
        except KeyboardInterrupt:  # a requested stop, as any other: exit 0
            print("pxrt serve: stopped while deploying", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - a deployment that failed to start
            print(f"pxrt serve: error: {exc}", file=sys.stderr)
            return 2
        finally:
            serve.shutdown()
            ray.shutdown()
    return 0
