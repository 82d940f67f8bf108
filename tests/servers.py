"""`pxrt serve` as a real process, for the tests that drive it over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open while choosing, so none repeats)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class ServeProcess:
    def __init__(self, args: list[str], grpc: bool = False):
        self.port, grpc_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_port = grpc_port if grpc else None
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        if grpc:
            args = [*args, "--grpc-port", str(self.grpc_port)]
        # A file, not a pipe: nobody reads a pipe while tests run, and a full one blocks.
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serving.cli", "serve", "--port", str(self.port), *args],
            cwd=ROOT,
            env=dict(os.environ),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pxrt serve exited: {self.output()}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        output = self.output()
        self.stop()
        raise RuntimeError(f"pxrt serve did not become ready: {output}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.log.close()
