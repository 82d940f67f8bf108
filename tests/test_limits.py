"""`pxrt serve` against clients that hold resources without finishing their requests:
oversized headers, slow headers and bodies, idle sockets, too many connections, many
large uploads at once. Raw sockets, since a client library would not misbehave."""

from __future__ import annotations

import json
import select
import signal
import socket
import threading
import time

import httpx
import pytest
from servers import ServeProcess

X = {"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0.5] * 32}
BODY = json.dumps({"inputs": [X]}).encode()


@pytest.fixture(scope="module")
def guarded(artifacts):
    proc = ServeProcess(
        [
            str(artifacts["mlp"]),
            "--max-connections", "12",
            "--max-header-kb", "4",
            "--header-timeout-s", "1",
            "--body-timeout-s", "1",
            "--request-timeout-s", "3",
            "--max-pending-body-mb", "1",
        ]
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0


def connect(proc: ServeProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proc.port), timeout=10)


def head(path: str, extra: str = "", length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra).encode()


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def infer_ok(proc: ServeProcess) -> bool:
    r = httpx.post(proc.url + "/v2/models/mlp/infer", content=BODY, timeout=10)
    return r.status_code == 200


def test_oversized_headers_get_431_and_the_connection_closes(guarded):
    with connect(guarded) as s:
        s.sendall(head("/v2/models/mlp/infer", "X-Junk: " + "a" * 8000 + "\r\n\r\n", len(BODY)))
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 431 ") and b'"error"' in reply and b"4096 bytes" in reply
    assert infer_ok(guarded)


def test_headers_that_never_finish_get_408(guarded):
    with connect(guarded) as s:
        s.sendall(head("/v2/models/mlp/infer"))  # and never the blank line
        t0 = time.monotonic()
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"headers" in reply
    assert 0.5 < time.monotonic() - t0 < 5


def test_an_idle_socket_is_closed(guarded):
    with connect(guarded) as s:
        t0 = time.monotonic()
        reply = read_all(s)  # we send nothing at all
    assert 0.5 < time.monotonic() - t0 < 5
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408 ")


def test_a_body_that_stalls_gets_408(guarded):
    with connect(guarded) as s:
        s.sendall(head("/v2/models/mlp/infer", "\r\n", len(BODY)) + BODY[:10])
        t0 = time.monotonic()
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"body" in reply
    assert 0.5 < time.monotonic() - t0 < 5


def test_a_trickled_body_hits_the_request_deadline(guarded):
    """One byte at a time, each pause under the body timeout: the request's deadline."""
    with connect(guarded) as s:
        s.sendall(head("/v2/models/mlp/infer", "\r\n", len(BODY)))
        t0 = time.monotonic()
        reply = b""
        try:
            for byte in BODY:
                s.sendall(bytes([byte]))
                time.sleep(0.5)
                if time.monotonic() - t0 > 6:
                    break
        except OSError:
            pass
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:80]
    assert time.monotonic() - t0 < 8


@pytest.mark.parametrize(
    "request_head",
    [
        "POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        "Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\nContent-Length: {n}\r\n\r\n",
        "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        "Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
    ],
    ids=["websocket with a body", "h2c"],
)
def test_a_request_to_upgrade_the_connection_gets_400_and_is_closed(guarded, request_head):
    """pxrt serves no WebSocket (or h2c): such a request is answered and its connection
    closed under the guard's watch (uvicorn's WebSocket handling kept the socket, with no
    answer and no timeout, for as long as the client liked)."""
    with connect(guarded) as s:
        s.sendall(request_head.format(n=len(BODY)).encode() + BODY)
        t0 = time.monotonic()
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 400 ") and b"upgrades no connection" in reply, reply
    assert time.monotonic() - t0 < 5
    assert infer_ok(guarded)


def test_a_trailing_slash_is_a_404_never_a_redirect(guarded):
    """Starlette redirects a path with a trailing slash to one built from the request's
    Host header: an open redirect. The API's paths have no trailing slash: 404."""
    for path in ("/v2/models/mlp/ready/", "/v2/models/mlp/", "/v2/health/live/", "/metrics/"):
        r = httpx.get(guarded.url + path, headers={"Host": "evil.example"}, timeout=10)
        assert r.status_code == 404 and "location" not in r.headers, (path, r.headers)
        assert "no endpoint" in r.json()["error"]


def test_connections_beyond_the_limit_get_503_and_one_log_line(guarded):
    """Beyond --max-connections a new connection is answered at once (503, Retry-After,
    Connection: close), not reset; the refusals are logged once per interval, counted."""
    socks = [connect(guarded) for _ in range(20)]
    try:
        # The refused ones answer at once; the others wait for a request (for the header
        # timeout, 1 s, longer than this wait).
        time.sleep(0.5)
        answered, _, _ = select.select(socks, [], [], 0)
        refused = 0
        for s in answered:
            reply = read_all(s)
            assert reply.startswith(b"HTTP/1.1 503 "), reply[:80]
            assert b"retry-after: 1\r\n" in reply and b"connection: close\r\n" in reply
            assert b"too many connections" in reply
            refused += 1
        assert refused >= 20 - 12
    finally:
        for s in socks:
            s.close()
    assert guarded.output().count("connection(s) in the last") == 1
    assert infer_ok(guarded)


def test_refused_clients_that_already_sent_a_request_read_the_503_not_a_reset(guarded):
    # A client that connects and sends its request at once (as every load generator
    # does) while the server is full: closing a socket with its bytes unread would make
    # the kernel answer RST, and the client would lose the 503. It reads the 503, then EOF.
    from serving.http.limits import linger_allowance

    held = [connect(guarded) for _ in range(12)]  # the cap: the server is full
    try:
        time.sleep(0.3)
        late = []
        for _ in range(linger_allowance(12)):  # (as many as may linger at once)
            s = connect(guarded)
            s.sendall(head("/v2/models/mlp/infer", length=len(BODY)) + b"\r\n" + BODY * 20)
            late.append(s)
        for s in late:
            reply = read_all(s)  # ConnectionResetError here without the linger
            assert reply.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in reply, reply[:80]
    finally:
        for s in held + late:
            s.close()
    assert infer_ok(guarded)


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP/1.1 response: (its head, its body); b"" when the server closed instead."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(
            v
            for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head.lower(), body


def test_kept_alive_connections_get_503_and_close_when_the_server_drains(artifacts):
    """SIGTERM: a request on a connection kept alive from before (busy or idle) is
    answered 503 + Connection: close, not reset; then the process exits 0."""
    proc = ServeProcess([str(artifacts["mlp"])])
    ready = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        busy, idle = connect(proc), connect(proc)
        for s in (busy, idle):
            s.sendall(ready)
            assert read_response(s)[0].startswith(b"http/1.1 200 ")
        proc.proc.send_signal(signal.SIGTERM)
        while True:  # the busy one: ready until the drain starts, then 503 and closed
            busy.sendall(ready)
            answer, _ = read_response(busy)
            assert answer, "the connection was closed without an answer"
            if not answer.startswith(b"http/1.1 200 "):
                break
        assert answer.startswith(b"http/1.1 503 ") and b"connection: close" in answer
        assert read_all(busy) == b""
        idle.sendall(head("/v2/models/mlp/infer", "\r\n", len(BODY)) + BODY)
        answer, body = read_response(idle)
        assert answer.startswith(b"http/1.1 503 ") and b"connection: close" in answer
        assert b"draining" in body
        assert read_all(idle) == b""
    finally:
        code = proc.stop()
    assert code == 0


def test_sigterm_under_keep_alive_load_resets_no_request(artifacts):
    """SIGTERM while 48 keep-alive clients send requests with pauses between them: every
    request is answered (200, or 503 draining with Connection: close), or its connection
    ends cleanly (an idle one the drain closed as the request crossed it: FIN, what came
    dropped); none is reset (the drain closed idle connections outright: the requests
    crossing the close were reset), and new connections are refused, not reset."""
    import http.client
    import random
    from collections import Counter

    proc = ServeProcess([str(artifacts["mlp"])])
    outcomes: Counter = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def client(seed):
        rng = random.Random(seed)
        conn = None
        while not stop.is_set():
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", proc.port, timeout=30)
                    conn.connect()
                conn.request("POST", "/v2/models/mlp/infer", BODY)
                reply = conn.getresponse()
                reply.read()
                outcome = f"status {reply.status}"
                if reply.getheader("connection", "").lower() == "close":
                    conn.close()
                    conn = None
                time.sleep(rng.uniform(0, 1.5))
            except http.client.RemoteDisconnected:
                outcome = "ended"  # (an EOF, no reset: it is a ConnectionResetError too)
                conn.close()
                conn = None
            except ConnectionRefusedError:
                outcome = "refused"
                conn = None
                time.sleep(0.05)
            except OSError as exc:
                outcome = f"RESET {type(exc).__name__}"
                if conn is not None:
                    conn.close()
                conn = None
            with lock:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(48)]
    for t in threads:
        t.start()
    time.sleep(4)
    proc.proc.send_signal(signal.SIGTERM)
    try:
        assert proc.proc.wait(60) == 0
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        proc.stop()
    assert not [k for k in outcomes if k.startswith("RESET")], outcomes
    assert outcomes["status 200"] > 48 and outcomes["status 503"] > 0, outcomes


def test_the_native_path_writes_uvicorns_access_lines(artifacts):
    """pxrt serve --log-level info: the native path's access lines are uvicorn's own
    (its formatter takes five arguments: four made a logging error of every request)."""
    proc = ServeProcess([str(artifacts["mlp"]), "--log-level", "info"])
    try:
        assert infer_ok(proc)
        deadline = time.monotonic() + 10
        while '"POST /v2/models/mlp/infer HTTP/1.1" 200' not in proc.output():
            assert time.monotonic() < deadline, proc.output()[-2000:]
            time.sleep(0.1)
        assert "Logging error" not in proc.output()
    finally:
        assert proc.stop() == 0


def test_many_large_uploads_at_once_get_503_not_memory(guarded):
    """Bodies held at once are bounded over all requests (here 1 MB): a third 400 KB
    upload in flight is refused with Retry-After while two are still being sent."""
    big = 400_000
    socks = []
    try:
        for _ in range(3):
            s = connect(guarded)
            s.sendall(head("/v2/models/mlp/infer", "\r\n", big) + b" " * 380_000)
            socks.append(s)
            time.sleep(0.2)
        s = socks[-1]
        s.settimeout(5)
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 503 ") and b"retry later" in reply
        assert b"retry-after: 1" in reply.lower()
    finally:
        for s in socks:
            s.close()


def test_good_clients_are_served_throughout(guarded):
    """While slow clients hold connections, a well-behaved client keeps getting answers."""
    stop = threading.Event()

    def slowloris():
        while not stop.is_set():
            try:
                with connect(guarded) as s:
                    s.sendall(head("/v2/models/mlp/infer"))
                    read_all(s)
            except OSError:
                pass

    attackers = [threading.Thread(target=slowloris, daemon=True) for _ in range(6)]
    for t in attackers:
        t.start()
    try:
        time.sleep(0.3)
        ok = sum(infer_ok(guarded) for _ in range(20))
    finally:
        stop.set()
        for t in attackers:
            t.join(10)
    assert ok == 20


def test_the_uvicorn_internals_the_guard_uses_are_there():
    """serving.http.limits subclasses uvicorn's httptools protocol and reads its state:
    when an upgrade moves what it relies on, this fails (not the server, at run time)."""
    import inspect

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from serving.http.limits import UVICORN_INTERNALS

    source = inspect.getsource(HttpToolsProtocol)
    for name in UVICORN_INTERNALS:
        assert hasattr(HttpToolsProtocol, name) or f"self.{name} =" in source, name
    cycle = inspect.getsource(inspect.getmodule(HttpToolsProtocol).RequestResponseCycle)
    for name in ("response_complete", "disconnected", "message_event"):
        assert f"self.{name} =" in cycle, name


def test_two_guarded_servers_on_one_loop_both_time_out_idle_sockets(run):
    # Each server's connections are swept (the sweep was once per loop: the second
    # server's idle sockets were never timed out).
    import asyncio

    import uvicorn
    from models import until
    from servers import free_ports
    from starlette.applications import Starlette

    from serving.http.limits import guarded_protocol
    from serving.options import HttpLimits

    async def main():
        servers = []
        for port in free_ports(2):
            config = uvicorn.Config(
                Starlette(), port=port, log_level="error", lifespan="off",
                http=guarded_protocol(HttpLimits(header_timeout_s=0.5)),
            )  # fmt: skip
            uv = uvicorn.Server(config)
            servers.append((port, uv, asyncio.ensure_future(uv.serve())))
        for _, uv, _ in servers:
            await until(lambda uv=uv: uv.started)
        readers = []
        for port, _, _ in servers:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            readers.append((reader, writer))
        answers = [await asyncio.wait_for(r.read(), 10) for r, _ in readers]
        for _, w in readers:
            w.close()
        for _, uv, task in servers:
            uv.should_exit = True
            await task
        return answers

    for answer in run(main):
        assert answer.startswith(b"HTTP/1.1 408 "), answer


def test_malformed_requests_are_logged_a_line_per_interval_with_their_count(run, caplog):
    """A client sending garbage on connection after connection (each answered 400 and
    closed) writes a line per interval with the count, not uvicorn's line each (736 in
    3 minutes, once)."""
    import asyncio
    import logging

    import uvicorn
    from models import until
    from servers import free_ports
    from starlette.applications import Starlette

    from serving.http.limits import guarded_protocol
    from serving.options import HttpLimits

    protocol = guarded_protocol(HttpLimits())
    [port] = free_ports(1)

    async def garbage() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x16\x03\x01 not HTTP at all\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return answer

    async def main():
        config = uvicorn.Config(
            Starlette(), port=port, log_level="warning", log_config=None, lifespan="off",
            http=protocol,
        )  # fmt: skip
        uv = uvicorn.Server(config)
        task = asyncio.ensure_future(uv.serve())
        await until(lambda: uv.started)
        answers = [await garbage() for _ in range(40)]
        protocol.malformed._next = 0.0  # (the interval is over: the next one writes a line)
        answers.append(await garbage())
        uv.should_exit = True
        await task
        return answers

    with caplog.at_level(logging.WARNING):
        answers = run(main)
    assert all(a.startswith(b"HTTP/1.1 400 ") for a in answers), answers[0]
    lines = [r.getMessage() for r in caplog.records]
    assert not [m for m in lines if "Invalid HTTP request" in m], lines[:3]
    malformed = [m for m in lines if "malformed HTTP request" in m]
    assert len(malformed) == 2, lines
    assert malformed[0].startswith("pxrt: answered 1 malformed HTTP request(s) 400 in the last")
    # The second line counts the 39 not written and itself.
    assert malformed[1].startswith("pxrt: answered 40 malformed HTTP request(s) 400")
    assert "(the last from 127.0.0.1:" in malformed[1] and protocol.malformed.total == 41
