"""``pxrt serve --process-id I`` (I > 0): a follower of a multi-host group.

It loads the model onto the group's global mesh, then runs the leader's batches
(``pxrt.multihost.Follower.follow``) until the leader stops the group (exit 0) or goes
away (exit 3, with a message that says so). SIGTERM or Ctrl-C: a requested stop, exit 0;
while it follows, it follows on until the leader stops the group (a group stopped whole
gets the signal on every process, and the batches its leader drains need every
follower), for at most ``STOP_GRACE_S``. It serves no inference: on ``--port`` it
answers ``/v2/health/live`` (200 while the process runs) and ``/v2/health/ready`` (200
while it follows the leader, 503 before and after) with its state as JSON; any other
path gets 503 naming the leader.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import sys
import threading
from typing import Any

LEADER_GONE = 3
# How long a follower told to stop follows on, waiting for its leader to stop the group:
# more than the leader's own drain (uvicorn's 30 s graceful shutdown, then gRPC's 5 s).
# Past it, the follower leaves on its own and the group is broken.
STOP_GRACE_S = 45.0


class _Health(http.server.BaseHTTPRequestHandler):
    server: Any  # a _HealthServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's spelling
        state = self.server.state()
        if self.path == "/v2/health/live":
            code = 200
        elif self.path == "/v2/health/ready":
            code = 200 if state["state"] == "following" else 503
        else:
            code = 503
            state = dict(
                state,
                error=f"process {state['process_id']} follows a multi-host group; "
                f"send requests to its leader (process 0, next to {state['coordinator']})",
            )
        body = json.dumps(state).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass


class _HealthServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: Any) -> None:
        super().__init__(address, _Health)
        self.state = state


def run_follower(cfg: Any, path: str, args: argparse.Namespace) -> int:
    """Load, follow, exit (see the module's doc for the exit codes; returns only when
    its health port cannot be had, before anything else)."""
    import pxrt
    from pxrt.multihost import LeaderGone

    held: dict[str, Any] = {"state": "loading", "follower": None}

    def state() -> dict:
        follower = held["follower"]
        return {
            "process_id": cfg.process_id,
            "num_processes": cfg.num_processes,
            "coordinator": cfg.coordinator,
            "role": "follower",
            "state": follower.state if follower is not None else held["state"],
            "batches": follower.steps if follower is not None else 0,
        }

    try:
        health = _HealthServer((args.host, args.port), state)
    except OSError as exc:
        print(f"pxrt serve: error: health on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    threading.Thread(target=health.serve_forever, name="pxrt-follower-health", daemon=True).start()

    def say(line: str) -> None:  # (not print: the main thread may be inside one)
        os.write(2, f"pxrt serve: process {cfg.process_id}: {line}\n".encode())

    def on_signal(*_: Any) -> None:
        follower = held["follower"]
        state = follower.state if follower is not None else held["state"]
        if state == "following":
            if not follower.stopping:
                say(f"stopping: following the leader until it stops the group "
                    f"(at most {STOP_GRACE_S:g} s)")  # fmt: skip
            follower.stop(STOP_GRACE_S)
        elif state in ("loading", "loaded", "connecting"):
            # No batch has run: nothing to finish, and the leader may not be there.
            say(f"stopped while {'loading' if state == 'loading' else 'connecting'}")
            os._exit(0)
        # else it is leaving already

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    code = 0
    try:
        follower = held["follower"] = pxrt.load(path, distributed=cfg)
        print(
            f"pxrt serve: process {cfg.process_id} of {cfg.num_processes} loaded "
            f"{follower.name} in {follower.load_s:.2f} s; following the leader at "
            f"{cfg.control_address[0]}:{cfg.control_address[1]} (health on "
            f"http://{args.host}:{args.port})",
            file=sys.stderr,
        )
        follower.follow()
        if follower.state == "left":
            print(
                f"pxrt serve: process {cfg.process_id}: left the group after "
                f"{follower.steps} batches, {STOP_GRACE_S:g} s after it was told to stop, "
                "before the leader stopped the group (the group is broken: restart it)",
                file=sys.stderr,
            )
        else:
            print(
                f"pxrt serve: process {cfg.process_id}: the leader stopped the group "
                f"after {follower.steps} batches",
                file=sys.stderr,
            )
    except LeaderGone as exc:
        print(f"pxrt serve: process {cfg.process_id}: {exc}", file=sys.stderr)
        code = LEADER_GONE
    except Exception as exc:  # noqa: BLE001 - reported, exit 2 as for any load error
        held["state"] = "failed"
        print(f"pxrt serve: error: process {cfg.process_id}: {exc}", file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    # At once, and not through jax's exit hooks: with the leader gone, jax's own
    # watchdog aborts the process when it notices, and its distributed shutdown would
    # wait for a coordination service that is not there. (The health server's thread
    # is a daemon's.)
    os._exit(code)
